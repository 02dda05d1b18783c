"""integrations/outlines: JSON to a Pydantic schema through the store equals the JSON without it, and reuses the handbook."""

from __future__ import annotations

from hf_prefix_cache import PrefixCache, load_smollm2
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
    served, requests = [], []
    for question in questions:  # one request block per question: what its call reused
        with store.request() as request:
            served += recipe.ask(generator, tokenizer, (question,), document, cache=store, max_new_tokens=64)
        requests.append(request)

    assert served == cold
    for text in served:
        recipe.Answer.model_validate_json(text)  # complete and valid: the schema held
    assert [(r.calls, r.fallbacks) for r in requests] == [(1, {}), (1, {})]
    assert requests[0].cached_tokens == 0
    assert requests[1].cached_tokens > 550, requests  # the handbook and the system turn around it
    assert requests[1].prompt_tokens - requests[1].cached_tokens < 40, requests  # only the new question is prefilled
    assert store.stats().hit_tokens == sum(r.cached_tokens for r in requests)
