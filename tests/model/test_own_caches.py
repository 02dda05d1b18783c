"""Models with their own cache (MiniMax's `MiniMaxCache`, RWKV's `state` list), served through a bridged working cache.

Each test compares the store's run with a cold run (tokens equal, logits within `LOGIT_TOL`) and
counts the hit tokens. MiniMax's lightning attention prefills in blocks of `block_size` tokens from
a zero state and feeds tokens one by one once a state exists; a small block size makes the
stored prompt span several blocks, and snapshot bounds fall inside them. RWKV's blocks read and
write their five states in place in the list `generate` hands them as `state`.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import transformers
from conftest import assert_same_as_cold, random_prompt

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.model.profile import profile_model
from hf_prefix_cache.testing.compare import served
from hf_prefix_cache.testing.snapshots import divergences, second_turn_and_repeat
from hf_prefix_cache.testing.tiny_build import seeded

INTERVAL = 10


@functools.cache
def _tiny_minimax() -> Any:
    """A float32 MiniMax of three layers: lightning (linear) attention, full attention, lightning attention."""
    config = transformers.MiniMaxConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"],
        num_local_experts=4, num_experts_per_tok=2, block_size=8, pad_token_id=0, bos_token_id=1, eos_token_id=None,
    )  # fmt: skip
    return seeded(transformers.MiniMaxForCausalLM, config)


@functools.cache
def _tiny_rwkv() -> Any:
    """A float32 RWKV of three blocks, its hidden states halved after every second block (`rescale_every`)."""
    config = transformers.RwkvConfig(
        vocab_size=128, hidden_size=64, attention_hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        rescale_every=2, pad_token_id=0, bos_token_id=1, eos_token_id=None,
    )  # fmt: skip
    return seeded(transformers.RwkvForCausalLM, config)


_MODELS = {"minimax": _tiny_minimax, "rwkv": _tiny_rwkv}


def test_rwkv_is_served_with_its_state_list_in_the_working_cache() -> None:
    model = _tiny_rwkv()
    profile = profile_model(model)
    assert profile.unsupported is None and profile.cache_kwarg == "state" and profile.has_state
    assert not profile.has_kv and len(profile.adapters) == 3


def test_minimax_is_served_with_a_working_cache_of_its_own_class() -> None:
    model = _tiny_minimax()
    profile = profile_model(model)
    assert profile.unsupported is None and profile.has_state and profile.has_kv
    store = PrefixCache(model)
    try:
        cache = store._store.new_cache()
        own = transformers.models.minimax.modeling_minimax.MiniMaxCache
        assert isinstance(cache, own) and len(cache) == 3 and cache.get_linear_cache(0) is None
    finally:
        store.detach()


@pytest.mark.parametrize("name", sorted(_MODELS))
def test_a_second_turn_and_a_repeat_reuse_the_stored_prompt_exactly(name: str) -> None:
    model = _MODELS[name]()
    with served(model, clean=False, snapshot_interval=INTERVAL) as store:
        # three blocks, the last one partial; the turn restores the snapshot at the first answer's end
        second_turn_and_repeat(model, store, random_prompt(21, seed=11), random_prompt(9, seed=12))


@pytest.mark.parametrize("name", sorted(_MODELS))
def test_a_divergence_restores_the_interval_snapshot_before_it(name: str) -> None:
    model = _MODELS[name]()
    with served(model, clean=False, snapshot_interval=INTERVAL) as store:
        # the last interval snapshot before the divergence at 25
        divergences(model, store, random_prompt(40, seed=13), [(25, random_prompt(10, seed=14), 20)])


def test_a_one_token_prompt_through_the_store_is_exact() -> None:
    """RWKV's first block reads its shift state before any is written: a one-token prompt starts from zeros."""
    model = _tiny_rwkv()
    store = PrefixCache(model)
    try:
        assert_same_as_cold(model, random_prompt(1, seed=15), store, new=4)
        assert not store.stats().fallbacks
    finally:
        store.detach()
