"""`PrefixCache(model, attach="all")`: calls that name no cache use the store; request scopes salt and report them."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import LOGIT_TOL, build, distinct_prompt, generate, max_logit_diff
from transformers import DynamicCache

from hf_prefix_cache import PrefixCache


def test_uncached_calls_reuse_exactly() -> None:
    """With attach="all", `generate` without a cache argument reuses the stored prompt and equals a cold run."""
    model = build("llama")
    ids = distinct_prompt(1, 40)
    longer = torch.cat([ids, distinct_prompt(2, 9)], dim=1)
    cold = [generate(model, ids), generate(model, longer)]
    store = PrefixCache(model, attach="all")
    try:
        warm = [generate(model, ids), generate(model, longer)]
        for a, b in zip(cold, warm, strict=True):
            assert torch.equal(a.sequences, b.sequences)
            assert max_logit_diff(a, b) < LOGIT_TOL
        stats = store.stats()
        assert stats.requests == 2
        assert stats.hit_tokens == ids.shape[1]  # the second prompt extends the first one
    finally:
        store.detach()


def test_a_call_with_its_own_cache_is_left_alone() -> None:
    """A call that passes its own DynamicCache runs untouched: the store neither serves nor counts it."""
    model = build("llama")
    ids = distinct_prompt(3, 30)
    cold = generate(model, ids)
    store = PrefixCache(model, attach="all")
    try:
        own = DynamicCache(config=model.config)
        out = generate(model, ids, past_key_values=own)
        assert torch.equal(out.sequences, cold.sequences)
        assert own.get_seq_length() == ids.shape[1] + 5
        assert store.stats().requests == 0 and store.stats().entries == 0
    finally:
        store.detach()


def test_off_by_default() -> None:
    """A plain `PrefixCache(model)` serves only calls that pass it: an uncached call is not counted."""
    model = build("llama")
    store = PrefixCache(model)
    try:
        generate(model, distinct_prompt(4, 20))
        assert store.stats().requests == 0 and store.stats().entries == 0
    finally:
        store.detach()


def test_detach_restores_the_model_exactly() -> None:
    """After `detach`, the model's attributes are what they were and uncached calls are no longer served."""
    model = build("llama")
    before = dict(vars(model))
    store = PrefixCache(model, attach="all")
    assert vars(model)["generate"] is not before.get("generate")
    store.detach()
    assert dict(vars(model)).keys() == before.keys()
    assert all(vars(model)[k] is v for k, v in before.items())
    assert model.generate.__func__ is type(model).generate
    generate(model, distinct_prompt(5, 20))
    assert store.stats().requests == 0


def test_attach_rejects_other_values() -> None:
    """`attach` is True, False or "all"; anything else is a ValueError that lists them."""
    with pytest.raises(ValueError, match='"all"'):
        PrefixCache(build("llama"), attach="everything")  # type: ignore[arg-type]


def test_request_scope_salts_and_reports() -> None:
    """A request's salt keeps its entries apart from other salts' and unsalted ones; its scope receives the hit."""
    model = build("llama")
    ids = distinct_prompt(6, 32)
    store = PrefixCache(model, attach="all")
    try:
        with store.request(salt="a") as first:
            generate(model, ids)
        assert first.cached_tokens == 0 and first.calls == 1
        with store.request(salt="a") as again:
            hit = generate(model, ids)
        assert again.cached_tokens == ids.shape[1] - 1
        with store.request(salt="b") as other:
            miss = generate(model, ids)
        assert other.cached_tokens == 0
        with store.request() as unsalted:
            generate(model, ids)
        assert unsalted.cached_tokens == 0  # nothing stored without a salt yet
        assert torch.equal(hit.sequences, miss.sequences)
        assert store.stats().hit_tokens == ids.shape[1] - 1
        store.check_integrity()
    finally:
        store.detach()


def test_request_scope_of_a_cold_run_counts_the_call_and_its_reason() -> None:
    """A call the store runs cold (no cache) is one call with nothing cached, and its reason, as in the stats."""
    model = build("llama")
    ids = distinct_prompt(7, 24)
    store = PrefixCache(model, attach="all")
    try:
        generate(model, ids)
        with store.request() as scope:
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, use_cache=False, do_sample=False)
        assert scope.calls == 1 and scope.cached_tokens == 0 and scope.prompt_tokens == ids.shape[1]
        assert scope.fallbacks == store.stats().fallbacks and sum(scope.fallbacks.values()) == 1
    finally:
        store.detach()


def test_scopes_are_per_thread() -> None:
    """A scope active in one thread is not seen by another, and is gone after its block."""
    model = build("llama")
    store = PrefixCache(model, attach="all")
    try:
        with store.request(salt="x") as scope:
            thread = threading.Thread(target=generate, args=(model, distinct_prompt(8, 20)))
            thread.start()
            thread.join()
        generate(model, distinct_prompt(8, 20))
        assert scope.calls == 0 and store.stats().requests == 2
        assert store.stats().hit_tokens == 19  # both ran outside the salted block: the second reuses the first
    finally:
        store.detach()


@pytest.mark.parametrize("salt", ["", 3])
def test_request_scope_rejects_bad_salts(salt: object) -> None:
    """A salt is a non-empty string."""
    with pytest.raises(ValueError, match="non-empty string"):
        PrefixCache(build("llama"), attach=False).request(salt=salt)  # type: ignore[arg-type]


def test_encoder_decoder_uncached_calls_reuse_exactly() -> None:
    """An encoder-decoder model (BART) attached with "all" serves uncached calls too: exact, decoder prefix and encoder reused."""
    from hooks.test_seq2seq import decoder_prompt, encoder_input, run, tiny

    model = tiny("bart")
    inputs = encoder_input("bart", seed=11)
    prompt = decoder_prompt(model, 7, 8, 9)
    cold = run(model, inputs, decoder_input_ids=prompt)
    store = PrefixCache(model, attach="all")
    try:
        for _ in range(2):
            warm = run(model, inputs, decoder_input_ids=prompt)
            assert torch.equal(warm.sequences, cold.sequences)
            assert max_logit_diff(warm, cold) < LOGIT_TOL
        stats = store.stats()
        assert stats.requests == 2 and stats.hit_tokens == prompt.shape[1] - 1 and stats.encoder_hits == 1
    finally:
        store.detach()
