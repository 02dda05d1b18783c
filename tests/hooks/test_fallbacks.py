"""Requests that cannot reuse safely run cold, count a named reason, and leave the store as it was."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import cached_model, generate, random_prompt
from transformers.generation.streamers import BaseStreamer

from hf_prefix_cache import IncompatibleModelError, PrefixCache


@pytest.fixture
def llama_store() -> Iterator[tuple[Any, PrefixCache]]:
    model = cached_model("llama")
    store = PrefixCache(model)
    # Something stored already, which no bad request may disturb.
    generate(model, random_prompt(30, seed=1), past_key_values=store)
    yield model, store
    store.check_integrity()
    store.detach()


def _footprint(store: PrefixCache) -> tuple[int, int, int]:
    s = store.stats()
    return s.nbytes, s.entries, s.nodes


def _assert_cold_and_counted(
    store: PrefixCache, reason: str, cold: Any, warm: Any, before: tuple[int, int, int]
) -> None:
    cold_ids = cold if isinstance(cold, torch.Tensor) else cold.sequences
    warm_ids = warm if isinstance(warm, torch.Tensor) else warm.sequences
    assert torch.equal(cold_ids, warm_ids)
    assert store.stats().fallbacks.get(reason) == 1, store.stats().fallbacks
    assert _footprint(store) == before


CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "use_cache_false": ("use_cache_false", {"use_cache": False}),
    "output_attentions": ("output_attentions", {"output_attentions": True, "return_dict_in_generate": True}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_generation_modes_that_cannot_reuse_run_cold(llama_store: tuple[Any, PrefixCache], case: str) -> None:
    """No cache and returned attentions run as if no store were given (beams, samples, assisted decoding and static
    caches are served: test_decoding_modes.py)."""
    model, store = llama_store
    reason, kwargs = CASES[case]
    ids = random_prompt(30, seed=1)
    before = _footprint(store)
    torch.manual_seed(0)
    cold = model.generate(ids, max_new_tokens=4, **kwargs)
    torch.manual_seed(0)
    warm = model.generate(ids, max_new_tokens=4, past_key_values=store, **kwargs)
    _assert_cold_and_counted(store, reason, cold, warm, before)


def test_batch_with_right_padding_runs_cold(llama_store: tuple[Any, PrefixCache]) -> None:
    """A right-padded batch gives the cold result and stores nothing (left padding is served: test_batches.py)."""
    model, store = llama_store
    ids = torch.cat([random_prompt(30, seed=1), random_prompt(30, seed=2)])
    mask = torch.ones_like(ids)
    ids[1, -5:], mask[1, -5:] = 0, 0
    before = _footprint(store)
    cold = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    warm = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, past_key_values=store)
    _assert_cold_and_counted(store, "padding", cold, warm, before)


def test_attention_mask_with_zeros_runs_cold(llama_store: tuple[Any, PrefixCache]) -> None:
    """A row with masked tokens inside it is not reused (positions would differ from the stored ones)."""
    model, store = llama_store
    ids = random_prompt(30, seed=1)
    mask = torch.ones_like(ids)
    mask[0, 10:13] = 0
    before = _footprint(store)
    cold = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    warm = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, past_key_values=store)
    _assert_cold_and_counted(store, "padding", cold, warm, before)


def test_inputs_embeds_without_ids_runs_cold(llama_store: tuple[Any, PrefixCache]) -> None:
    """Embeddings cannot be matched against stored token ids."""
    model, store = llama_store
    embeds = model.get_input_embeddings()(random_prompt(30, seed=1))
    before = _footprint(store)
    cold = model.generate(inputs_embeds=embeds, max_new_tokens=4, do_sample=False)
    warm = model.generate(inputs_embeds=embeds, max_new_tokens=4, do_sample=False, past_key_values=store)
    _assert_cold_and_counted(store, "inputs_embeds", cold, warm, before)


class _Collect(BaseStreamer):
    def __init__(self) -> None:
        self.chunks: list[list[int]] = []

    def put(self, value: torch.Tensor) -> None:
        self.chunks.append(value.flatten().tolist())

    def end(self) -> None:
        self.chunks.append([])


def test_streamer_sees_what_a_cold_run_shows(llama_store: tuple[Any, PrefixCache]) -> None:
    """A streamer gets the full prompt and then each new token, exactly as in a cold run, on a hit."""
    model, store = llama_store
    ids = random_prompt(30, seed=1)
    cold, warm = _Collect(), _Collect()
    model.generate(ids, max_new_tokens=5, do_sample=False, streamer=cold)
    hits = store.stats().hit_tokens
    model.generate(ids, max_new_tokens=5, do_sample=False, streamer=warm, past_key_values=store)
    assert store.stats().hit_tokens - hits == 29
    assert warm.chunks == cold.chunks


def test_store_of_another_model_is_refused() -> None:
    """Handing a store to a different model raises an error that says which model it belongs to."""
    llama, qwen = cached_model("llama"), cached_model("qwen3")
    store, other = PrefixCache(llama), PrefixCache(qwen)
    try:
        with pytest.raises(IncompatibleModelError, match="LlamaForCausalLM"):
            qwen.generate(random_prompt(10), past_key_values=store, max_new_tokens=2)
    finally:
        store.detach()
        other.detach()


def test_store_used_as_a_cache_in_forward_says_what_to_do() -> None:
    """Passing the store to a plain forward fails with a message naming the right use."""
    model = cached_model("llama")
    store = PrefixCache(model)
    try:
        with pytest.raises(AttributeError, match="is a store, not a transformers Cache"):
            model(random_prompt(10), past_key_values=store)
    finally:
        store.detach()


def test_calls_without_the_store_are_untouched() -> None:
    """generate() without the store returns what it returned before the store was attached."""
    model = cached_model("gpt2")
    ids = random_prompt(30, seed=7)
    before = generate(model, ids)
    store = PrefixCache(model)
    try:
        after = generate(model, ids)
        assert torch.equal(before.sequences, after.sequences)
        assert store.stats().requests == 0
    finally:
        store.detach()
    assert "generate" not in vars(model)


def test_batch_on_a_model_with_window_states_runs_cold() -> None:
    """Batches on models whose sliding layers are kept as windows are not reused (a window restores for one row)."""
    model = cached_model("mistral")
    store = PrefixCache(model, sliding_window_mode="window")
    try:
        ids = torch.cat([random_prompt(20, seed=1), random_prompt(20, seed=2)])
        cold = model.generate(ids, max_new_tokens=3, do_sample=False)
        warm = model.generate(ids, max_new_tokens=3, do_sample=False, past_key_values=store)
        _assert_cold_and_counted(store, "batch_size", cold, warm, (0, 0, 0))
    finally:
        store.detach()


def test_a_model_default_cache_implementation_does_not_block_reuse() -> None:
    """Gemma checkpoints default to cache_implementation="hybrid"; a call through the store still reuses, exactly."""
    model = cached_model("gemma2")
    store = PrefixCache(model)
    previous = model.generation_config.cache_implementation
    model.generation_config.cache_implementation = "hybrid"
    try:
        ids = random_prompt(30, seed=3)
        generate(model, ids, past_key_values=store)
        cold = generate(model, ids)
        warm = generate(model, ids, past_key_values=store)
        assert torch.equal(cold.sequences, warm.sequences)
        assert store.stats().hit_tokens == 29 and not store.stats().fallbacks
    finally:
        model.generation_config.cache_implementation = previous
        store.detach()


def test_model_kwargs_the_key_does_not_cover_run_cold() -> None:
    """GPT-2's `token_type_ids` reach its embeddings: a stored prompt with other (or no) type ids must not be reused."""
    from conftest import assert_same_as_cold

    model = cached_model("gpt2")
    store = PrefixCache(model)
    try:
        ids = random_prompt(20, seed=3)
        assert_same_as_cold(model, ids, store)  # stored without type ids
        before = store.stats().hit_tokens
        types = torch.ones_like(ids)
        assert_same_as_cold(model, ids, store, token_type_ids=types)
        assert store.stats().hit_tokens == before
        assert store.stats().fallbacks == {"model_kwarg:token_type_ids": 1}
        # A setting of generate itself is no model kwarg: served.
        assert_same_as_cold(model, ids, store, repetition_penalty=1.3)
        assert store.stats().hit_tokens == before + ids.shape[1] - 1
    finally:
        store.detach()
