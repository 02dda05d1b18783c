"""Settings a checkpoint ships in its generation_config never make a call through the store fail where cold would not."""

from __future__ import annotations

import pytest
import torch
from conftest import Hits, assert_same_as_cold, build, distinct_prompt, generate

from hf_prefix_cache import PrefixCache


@pytest.mark.parametrize("impl", ["dynamic", "static", "sliding_window", "offloaded", "quantized"])
def test_a_model_default_cache_implementation(impl: str) -> None:
    """`dynamic` and `static` (and `sliding_window`, a deprecated name of the static cache) are served and reused; any
    other runs cold with its name, raising only what a cold run raises."""
    model = build("llama")
    model.generation_config.cache_implementation = impl
    store = PrefixCache(model)
    ids = distinct_prompt(1)
    try:
        try:
            generate(model, ids)
        except Exception as cold_error:
            with pytest.raises(type(cold_error)):
                generate(model, ids, past_key_values=store)
            assert store.stats().fallbacks == {f"cache_implementation:{impl}": 1}
            return
        hits = Hits(store)
        assert_same_as_cold(model, ids, store)
        assert_same_as_cold(model, ids, store)
        if impl in ("dynamic", "static", "sliding_window"):
            assert hits.last() == ids.shape[1] - 1
            assert store.stats().fallbacks == {}
        else:
            assert hits.last() == 0
            assert store.stats().fallbacks == {f"cache_implementation:{impl}": 2}
    finally:
        store.detach()


def test_an_explicit_dynamic_cache_implementation_is_served() -> None:
    """`generate(..., cache_implementation="dynamic")` reuses like a call without it."""
    model = build("llama")
    store = PrefixCache(model)
    ids = distinct_prompt(2)
    hits = Hits(store)
    try:
        assert_same_as_cold(model, ids, store, cache_implementation="dynamic")
        assert_same_as_cold(model, ids, store, cache_implementation="dynamic")
        assert hits.last() == ids.shape[1] - 1
    finally:
        store.detach()


@pytest.mark.parametrize("impl", ["dynamic", "static"])
def test_a_seq2seq_model_default_cache_implementation_is_served_or_runs_cold_and_never_raises(impl: str) -> None:
    """BART with a cache_implementation in its generation_config equals cold: "dynamic" (what the store runs on)
    is served, any other runs cold with its reason."""
    from hooks.test_seq2seq import BUILDERS, encoder_input, same_as_cold

    torch.manual_seed(0)
    model = BUILDERS["bart"]().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.forced_eos_token_id = None
    model.generation_config.do_sample = False
    model.generation_config.cache_implementation = impl
    store = PrefixCache(model)
    try:
        same_as_cold(model, store, encoder_input("bart", 1))
        expected = {} if impl == "dynamic" else {f"cache_implementation:{impl}": 1}
        assert store.stats().fallbacks == expected
    finally:
        store.detach()
