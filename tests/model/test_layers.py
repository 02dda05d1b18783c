"""The transformers 5.23 behaviours the layer adapters rely on, checked directly.

If a transformers release changes one of these, these tests fail before any wrong answer
can be served.
"""

from __future__ import annotations

import pytest
import torch
from conftest import LOGIT_TOL, assert_same_as_cold, cached_model, random_prompt
from transformers import DynamicCache

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.model.layers import adapter_for


def test_dynamic_layer_tensors_are_never_written_in_place() -> None:
    """Continuing a DynamicCache leaves the earlier key tensors untouched (so views can be shared)."""
    model = cached_model("llama")
    store = PrefixCache(model, attach=False)
    with torch.no_grad():
        cache = store._store.new_cache()
        model(random_prompt(20, seed=1), past_key_values=cache, use_cache=True)
        keys = cache.layers[0].keys
        frozen = keys.clone()
        model(random_prompt(5, seed=2), past_key_values=cache, use_cache=True)
    assert torch.equal(keys, frozen)
    assert cache.layers[0].keys.shape[-2] == 25


def test_recurrent_states_are_written_in_place_so_snapshots_clone() -> None:
    """A linear-attention layer mutates its state tensor in place; a snapshot taken before is unaffected."""
    model = cached_model("bamba")
    store = PrefixCache(model, attach=False)
    linear = store._store.profile.state_layers[0]
    with torch.no_grad():
        cache = store._store.new_cache()
        model(random_prompt(20, seed=1), past_key_values=cache, use_cache=True, position_ids=torch.arange(20)[None])
        live = cache.layers[linear].recurrent_states[0]
        before = live.clone()
        snapshot = cache.snapshot(20)
        model(random_prompt(1, seed=2), past_key_values=cache, use_cache=True, position_ids=torch.tensor([[20]]))
    assert cache.layers[linear].recurrent_states[0].data_ptr() == live.data_ptr()  # same storage ...
    assert not torch.equal(live, before)  # ... new contents
    assert torch.equal(snapshot.states[linear].tensors["recurrent_states"][0], before)


def test_sliding_layers_keep_every_position_in_a_working_cache() -> None:
    """With past recording on, a sliding layer holds all positions while attending to its window only."""
    model = cached_model("mistral")
    store = PrefixCache(model, attach=False)
    with torch.no_grad():
        cache = store._store.new_cache()
        model(random_prompt(30, seed=1), past_key_values=cache, use_cache=True)
    layer = cache.layers[0]
    assert layer.sliding_window < 30
    assert layer.keys.shape[-2] == 30 and layer.cumulative_length == 30


def test_mamba_multi_token_continuation_is_wrong_in_transformers_but_served_exactly() -> None:
    """Mamba-1 ignores a cached state for several new tokens; the store continues its scan and stays exact."""
    model = cached_model("mamba")
    store = PrefixCache(model, snapshot_interval=None)
    try:
        prefix, suffix = random_prompt(30, seed=1), random_prompt(12, seed=2)
        full = torch.cat([prefix, suffix], 1)
        with torch.no_grad():
            plain, ours = DynamicCache(config=model.config), store._store.new_cache()
            at_once = []
            for cache in (plain, ours):
                model(prefix, cache_params=cache, use_cache=True)
                at_once.append(model(suffix, cache_params=cache, use_cache=True).logits[:, -1])
            reference = model(full).logits[:, -1]
        assert (at_once[0] - reference).abs().max() > 1e-4  # transformers' own continuation is off
        assert (at_once[1] - reference).abs().max() < LOGIT_TOL  # a working cache continues the scan
        # A 31-token prompt leaves a snapshot after token 30 (the state the last token is fed on).
        model.generate(torch.cat([prefix, random_prompt(1, seed=3)], 1), past_key_values=store, max_new_tokens=2)
        assert_same_as_cold(model, full, store)
        assert store.stats().hit_tokens == 30  # restored at 30, then fed the 12-token suffix in one continued scan
    finally:
        store.detach()


def test_unknown_layer_classes_are_refused_not_guessed() -> None:
    """Subclasses of supported layers (indexers, quantized copies) get no adapter."""
    from transformers.cache_utils import DynamicIndexedLayer, DynamicLayer, StaticLayer

    assert adapter_for(DynamicLayer()) is not None
    assert adapter_for(DynamicIndexedLayer()) is None
    assert adapter_for(StaticLayer(max_cache_len=8)) is None


def test_a_key_indexed_layer_is_stored_as_its_keys_and_refuses_indexer_keys() -> None:
    """Kolibri 1.1's indexed layers keep no indexer keys: stored as full attention, never with a lost indexer."""
    from transformers.cache_utils import DynamicIndexedLayer

    adapter = adapter_for(DynamicIndexedLayer(), indexes_keys=True)
    assert adapter is not None and adapter.has_kv and not adapter.has_indexer_keys
    assert not adapter.has_static_form and not adapter.defers_keys
    layer = DynamicIndexedLayer()
    keys, values = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    layer.update(keys, values)
    captured = adapter.capture_kv(layer)
    assert captured is not None and torch.equal(captured[0], keys) and torch.equal(captured[1], values)
    layer.update_indexer(torch.randn(1, 5, 8))
    with pytest.raises(InconsistentStateError, match="indexer keys"):
        adapter.capture_kv(layer)
