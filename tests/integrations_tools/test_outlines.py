"""integrations/outlines: JSON to a Pydantic schema through the store equals the JSON without it, and reuses the handbook."""

from __future__ import annotations

from hf_prefix_cache import PrefixCache, RequestEvent, load_smollm2
from integrations_tools.examples import example, require, short_handbook, smollm2_dir

require("outlines")


def test_schema_constrained_answers_equal_the_run_without_the_store_and_the_second_reuses_the_handbook() -> None:
    """Two questions: the same valid JSON with and without `cache=store`; the second restores the handbook."""
    smollm2_dir()
    recipe = example("outlines/json_schema.py")
    model, tokenizer = load_smollm2()
    generator = recipe.build(model, tokenizer)
    questions = recipe.QUESTIONS[:2]
    document = short_handbook()
    cold = recipe.ask(generator, tokenizer, questions, document, max_new_tokens=64)

    store = PrefixCache(model)
    events: list[RequestEvent] = []
    store.on_request(events.append)
    served = recipe.ask(generator, tokenizer, questions, document, cache=store, max_new_tokens=64)

    assert served == cold
    for text in served:
        recipe.Answer.model_validate_json(text)  # complete and valid: the schema held
    assert [event.fallback for event in events] == [None, None]
    assert events[0].hit_len == 0
    assert events[1].hit_len > 550, events  # the handbook and the system turn around it
    assert events[1].prompt_len - events[1].hit_len < 40, events  # only the new question is prefilled
