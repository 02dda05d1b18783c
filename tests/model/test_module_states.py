"""RecurrentGemma's module-kept recurrence, served through the working cache's layers (`model/module_states.py`).

Each test compares the store's run with a cold run (tokens equal, logits within `LOGIT_TOL`) and
counts the hit tokens. Cold runs between the store's runs reset the blocks' module state
themselves, so a restore that relied on what the modules last held would show here.
"""

from __future__ import annotations

import torch
from conftest import Hits, assert_same_as_cold, cached_model, random_prompt

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.model.module_states import ModuleStateBridge, has_module_states
from hf_prefix_cache.model.profile import profile_model

INTERVAL = 10


def test_recurrent_gemma_is_served_and_its_blocks_are_bridged() -> None:
    model = cached_model("recurrent_gemma")  # [recurrent, recurrent, local attention (window 8)]
    assert has_module_states(model)
    profile = profile_model(model)
    assert profile.unsupported is None and profile.has_state and profile.has_kv and profile.single_token_steps
    assert ModuleStateBridge.install(torch.nn.Linear(2, 2), object) is None


def test_a_second_turn_and_a_repeat_reuse_the_stored_prompt_exactly() -> None:
    model = cached_model("recurrent_gemma")
    store = PrefixCache(model, snapshot_interval=INTERVAL)
    try:
        hits = Hits(store)
        prompt = random_prompt(23, seed=21)  # longer than the attention window
        first = assert_same_as_cold(model, prompt, store, new=4)
        assert hits.last() == 0
        turn = torch.cat([first.sequences, random_prompt(9, seed=22)], 1)
        assert_same_as_cold(model, turn, store, new=4)
        assert hits.last() == first.sequences.shape[1] - 1  # the snapshot at the first answer's end
        assert_same_as_cold(model, turn, store, new=4)
        assert hits.last() == turn.shape[1] - 1
        assert not store.stats().fallbacks
    finally:
        store.detach()


def test_divergences_restore_the_snapshots_before_them() -> None:
    """A prompt fed whole from an empty state takes no interval snapshot (its multi-token forward is exact only
    from zeros); one resumed from a snapshot is fed a token per forward and snapshots every `INTERVAL`."""
    model = cached_model("recurrent_gemma")
    store = PrefixCache(model, snapshot_interval=INTERVAL)
    try:
        hits = Hits(store)
        prompt = random_prompt(40, seed=23)
        assert_same_as_cold(model, prompt, store, new=3)
        other = torch.cat([prompt[:, :25], random_prompt(10, seed=24)], 1)
        assert_same_as_cold(model, other, store, new=3)
        assert hits.last() == 0  # no snapshot before 25 yet; it snapshots at 25, then from there at 30 and 34
        third = torch.cat([other[:, :33], random_prompt(6, seed=25)], 1)
        assert_same_as_cold(model, third, store, new=3)
        assert hits.last() == 30  # an interval snapshot taken while fed a token per forward
        fourth = torch.cat([third[:, :36], random_prompt(6, seed=26)], 1)
        assert_same_as_cold(model, fourth, store, new=3)
        assert hits.last() == 33  # the third request's divergence, reached from 30 a token per forward
        assert_same_as_cold(model, fourth, store, new=3)
        assert hits.last() == fourth.shape[1] - 1
    finally:
        store.detach()


def test_detach_removes_the_bridge() -> None:
    model = cached_model("recurrent_gemma")
    decoder = model.model
    before = (len(decoder._forward_pre_hooks), len(decoder._forward_hooks))
    store = PrefixCache(model)
    assert (len(decoder._forward_pre_hooks), len(decoder._forward_hooks)) == (before[0] + 1, before[1] + 1)
    store.detach()
    assert (len(decoder._forward_pre_hooks), len(decoder._forward_hooks)) == before
