"""RecurrentGemma's module-kept recurrence, served through the working cache's layers (`model/module_states.py`).

Each test compares the store's run with a cold run (tokens equal, logits within `LOGIT_TOL`) and
counts the hit tokens. Cold runs between the store's runs reset the blocks' module state
themselves, so a restore that relied on what the modules last held would show here.
"""

from __future__ import annotations

import torch
from conftest import cached_model, random_prompt

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.model.module_states import ModuleStateBridge, has_module_states
from hf_prefix_cache.model.profile import profile_model
from hf_prefix_cache.testing.compare import served
from hf_prefix_cache.testing.snapshots import divergences, second_turn_and_repeat

INTERVAL = 10


def test_recurrent_gemma_is_served_and_its_blocks_are_bridged() -> None:
    model = cached_model("recurrent_gemma")  # [recurrent, recurrent, local attention (window 8)]
    assert has_module_states(model)
    profile = profile_model(model)
    assert profile.unsupported is None and profile.has_state and profile.has_kv and profile.single_token_steps
    assert ModuleStateBridge.install(torch.nn.Linear(2, 2), object) is None


def test_a_second_turn_and_a_repeat_reuse_the_stored_prompt_exactly() -> None:
    model = cached_model("recurrent_gemma")
    with served(model, clean=False, snapshot_interval=INTERVAL) as store:
        # longer than the attention window; the turn restores the snapshot at the first answer's end
        second_turn_and_repeat(model, store, random_prompt(23, seed=21), random_prompt(9, seed=22))


def test_divergences_restore_the_snapshots_before_them() -> None:
    """A prompt fed whole from an empty state takes no interval snapshot (its multi-token forward is exact only
    from zeros); one resumed from a snapshot is fed a token per forward and snapshots every `INTERVAL`."""
    model = cached_model("recurrent_gemma")
    steps = [
        (25, random_prompt(10, seed=24), 0),  # no snapshot before 25 yet; it snapshots at 25, then at 30 and 34
        (33, random_prompt(6, seed=25), 30),  # an interval snapshot taken while fed a token per forward
        (36, random_prompt(6, seed=26), 33),  # the third request's divergence, reached from 30 a token per forward
    ]
    with served(model, clean=False, snapshot_interval=INTERVAL) as store:
        divergences(model, store, random_prompt(40, seed=23), steps)


def test_detach_removes_the_bridge() -> None:
    model = cached_model("recurrent_gemma")
    decoder = model.model
    before = (len(decoder._forward_pre_hooks), len(decoder._forward_hooks))
    store = PrefixCache(model)
    assert (len(decoder._forward_pre_hooks), len(decoder._forward_hooks)) == (before[0] + 1, before[1] + 1)
    store.detach()
    assert (len(decoder._forward_pre_hooks), len(decoder._forward_hooks)) == before
