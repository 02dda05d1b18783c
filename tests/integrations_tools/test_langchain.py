"""integrations/langchain: ChatHuggingFace turns and a long-preamble chain reuse their prefixes, with the same answers."""

from __future__ import annotations

from hf_prefix_cache import PrefixCache, RequestEvent, load_smollm2
from integrations_tools.examples import example, require, short_handbook, smollm2_dir

require("langchain_core", "langchain_huggingface")


def test_chat_turns_and_chain_questions_reuse_what_came_before_and_answer_as_without_the_store() -> None:
    """From turn 2 each chat turn restores the previous prompt, question 2 restores the handbook; answers equal cold."""
    smollm2_dir()
    recipe = example("langchain/chat.py")
    model, tokenizer = load_smollm2()
    llm = recipe.build_llm(model, tokenizer, max_new_tokens=16)
    questions = recipe.QUESTIONS[:2]
    document = short_handbook()
    cold = recipe.chat(llm, tokenizer), recipe.ask_handbook(llm, questions, document)

    store = PrefixCache(model, attach="all")
    events: list[RequestEvent] = []
    store.on_request(events.append)  # each call's event, beside the blocks' sums
    with store.request() as chat_request:
        chat_answers = recipe.chat(llm, tokenizer)
    with store.request() as chain_request:
        served = chat_answers, recipe.ask_handbook(llm, questions, document)
    store.detach()

    assert served == cold
    assert all(answer.strip() for answers in served for answer in answers)
    assert [event.fallback for event in events] == [None] * 5
    turns, chain = events[:3], events[3:]
    assert turns[0].hit_len == 0
    for before, after in zip(turns, turns[1:], strict=False):
        assert after.hit_len >= before.prompt_len, (before, after)  # the whole previous turn's prompt, at least
    assert chain[0].hit_len < 20  # the handbook is new here: only the chat template's first tokens are shared
    assert chain[1].hit_len > 550, chain  # the handbook, prefilled once
    assert store.stats().hit_tokens == sum(event.hit_len for event in events)
    for request, calls in ((chat_request, turns), (chain_request, chain)):
        assert request.calls == len(calls) and request.fallbacks == {}
        assert request.cached_tokens == sum(event.hit_len for event in calls)
        assert request.prompt_tokens == sum(event.prompt_len for event in calls)
