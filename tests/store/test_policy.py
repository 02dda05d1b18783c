"""Eviction policy and entry rules: LRU and cost-aware order, TTL, entry count, minimum length,
pinned prefixes, sessions that keep a conversation warm, and memory-pressure callbacks."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from conftest import assert_same_as_cold, cached_model, distinct_prompt, generate, kv_bytes_per_token, random_prompt

from hf_prefix_cache import PrefixCache, PressureEvent


def _cached_len(store: PrefixCache, ids: torch.Tensor) -> int:
    with store.lookup(ids) as hit:
        return hit.cached_len


@pytest.fixture
def llama() -> Any:
    return cached_model("llama")


def test_cost_policy_keeps_small_entries_that_save_as_much_per_byte() -> None:
    """Under the cost policy a hybrid model's snapshot-heavy entry outlives plain entries of similar age."""
    model = cached_model("jamba")
    kinds = {}
    for policy in ("lru", "cost"):
        store = PrefixCache(model, policy=policy, snapshot_interval=None)
        try:
            long_ids = random_prompt(60, seed=1)
            generate(model, long_ids, new=1, past_key_values=store)  # 60 tokens behind one snapshot
            one = store.stats().nbytes
            store.max_bytes = int(one * 2.5)
            for seed in range(2, 6):
                generate(model, distinct_prompt(seed, 8), new=1, past_key_values=store)  # short, recent entries
            kinds[policy] = _cached_len(store, torch.cat([long_ids, distinct_prompt(7, 2)], 1))
            store.check_integrity()
        finally:
            store.detach()
    assert kinds["lru"] == 0  # LRU dropped the oldest, however much it saved
    assert kinds["cost"] == 60  # cost-aware kept it: it spares 60 tokens of prefill for its bytes


def test_ttl_drops_entries_unused_for_longer(llama: Any) -> None:
    """An entry unused for longer than `ttl` seconds is dropped on the next store operation."""
    store = PrefixCache(llama, ttl=0.2)
    try:
        old, fresh = distinct_prompt(1), distinct_prompt(2)
        generate(llama, old, new=1, past_key_values=store)
        time.sleep(0.3)
        generate(llama, fresh, new=1, past_key_values=store)
        assert store.stats().expired == 1
        assert _cached_len(store, old) == 0 and _cached_len(store, fresh) == 29
        store.check_integrity()
    finally:
        store.detach()


def test_max_entries_keeps_the_most_recent(llama: Any) -> None:
    """With `max_entries` the least recently used entries beyond the count are dropped."""
    store = PrefixCache(llama, max_entries=2)
    try:
        for seed in range(4):
            generate(llama, distinct_prompt(seed), new=1, past_key_values=store)
            assert store.stats().entries <= 2
        assert [_cached_len(store, distinct_prompt(s)) for s in range(4)] == [0, 0, 29, 29]
    finally:
        store.detach()


def test_sequences_below_min_store_len_are_served_not_stored(llama: Any) -> None:
    """Short sequences are served exactly but not stored when below `min_store_len`."""
    store = PrefixCache(llama, min_store_len=20)
    try:
        assert_same_as_cold(llama, distinct_prompt(1, 10), store, new=3)
        assert store.stats().entries == 0
        assert store.stats().fallbacks == {"entry_below_min_store_len": 1}
        generate(llama, distinct_prompt(2, 30), new=1, past_key_values=store)
        assert store.stats().entries == 1
    finally:
        store.detach()


def test_pinned_system_prompt_survives_any_pressure(llama: Any) -> None:
    """A pinned prefix is computed once and never evicted, whatever else is stored; unpin releases it."""
    per_token = kv_bytes_per_token(llama)
    store = PrefixCache(llama, max_bytes=60 * per_token)
    try:
        system = random_prompt(25, seed=3)
        assert store.pin(system) == 25
        for seed in range(6):
            generate(llama, distinct_prompt(10 + seed), new=1, past_key_values=store)
            assert store.stats().nbytes <= 60 * per_token
        question = torch.cat([system, random_prompt(6, seed=4)], 1)
        before = store.stats().hit_tokens
        assert_same_as_cold(llama, question, store)
        assert store.stats().hit_tokens - before == 25
        assert store.unpin(system) and not store.unpin(system)
        for seed in range(6):
            generate(llama, distinct_prompt(20 + seed), new=1, past_key_values=store)
        assert _cached_len(store, system) == 0
        store.check_integrity()
    finally:
        store.detach()


def test_session_keeps_its_latest_turn_warm(llama: Any) -> None:
    """A session's latest entry survives pressure that evicts everything else; closing it lets it go."""
    per_token = kv_bytes_per_token(llama)
    store = PrefixCache(llama, max_bytes=80 * per_token)
    try:
        chat = store.session("alice")
        turn1 = random_prompt(20, seed=5)
        out1 = generate(llama, turn1, past_key_values=chat)
        turn2 = torch.cat([out1.sequences, random_prompt(5, seed=6)], 1)
        out2 = generate(llama, turn2, past_key_values=chat)
        assert chat.held_len == out2.sequences.shape[1] - 1
        for seed in range(6):
            generate(llama, distinct_prompt(30 + seed, 20), new=1, past_key_values=store)
        turn3 = torch.cat([out2.sequences, random_prompt(5, seed=7)], 1)
        before, held = store.stats().hit_tokens, chat.held_len
        assert_same_as_cold(llama, turn3, chat)
        assert store.stats().hit_tokens - before == held  # all of turn 2 but its never-fed last token
        assert store.session("alice") is chat
        chat.close()
        with pytest.raises(ValueError, match="closed"):
            generate(llama, turn3, past_key_values=chat)
        assert all(node.lock_ref == 0 for node in store._store._tree.iter_nodes())
        store.check_integrity()
    finally:
        store.detach()


def test_pressure_callback_fires_once_per_crossing(llama: Any) -> None:
    """A callback hears each threshold once when use rises past it, again only after use fell below."""
    per_token = kv_bytes_per_token(llama)
    store = PrefixCache(llama, max_bytes=100 * per_token)
    events: list[PressureEvent] = []
    store.on_pressure(events.append, thresholds=(0.5, 0.9))
    try:
        generate(llama, distinct_prompt(1, 30), new=1, past_key_values=store)  # 30%
        assert events == []
        generate(llama, distinct_prompt(2, 30), new=1, past_key_values=store)  # 60%
        assert [(e.tier, e.threshold) for e in events] == [("device", 0.5)]
        generate(llama, distinct_prompt(3, 35), new=1, past_key_values=store)  # 95%
        assert [e.threshold for e in events] == [0.5, 0.9]
        assert events[-1].fraction >= 0.9 and events[-1].max_bytes == 100 * per_token
        generate(llama, distinct_prompt(4, 30), new=1, past_key_values=store)  # evicts, stays high
        assert len(events) == 2
    finally:
        store.detach()
    with pytest.raises(ValueError, match="fractions"):
        store.on_pressure(events.append, thresholds=(1.5,))


def test_exact_repeat_refreshes_the_entry_and_a_session_holds_it(llama: Any) -> None:
    """Re-storing an already stored sequence changes no bytes, but counts as a use and is held by a session."""
    per_token = kv_bytes_per_token(llama)
    store = PrefixCache(llama, max_bytes=70 * per_token)
    try:
        first, second = distinct_prompt(1, 30), distinct_prompt(2, 30)
        generate(llama, first, new=1, past_key_values=store)  # 30 tokens stored
        generate(llama, second, new=1, past_key_values=store)
        nbytes = store.stats().nbytes
        chat = store.session("repeat")
        generate(llama, first, new=1, past_key_values=chat)  # exact repeat: nothing new to store
        assert store.stats().nbytes == nbytes
        assert chat.held_len == 30
        chat.close()
        # The repeat made `first` the most recent entry, so pressure evicts `second`.
        generate(llama, distinct_prompt(3, 30), new=1, past_key_values=store)
        assert _cached_len(store, first) == 29 and _cached_len(store, second) == 0
        # Without a session the repeat stores nothing at all, yet still counts as a use.
        generate(llama, first, new=1, past_key_values=store)
        assert store.stats().nbytes == nbytes
        generate(llama, distinct_prompt(4, 30), new=1, past_key_values=store)
        assert _cached_len(store, first) == 29 and _cached_len(store, distinct_prompt(3, 30)) == 0
        store.check_integrity()
    finally:
        store.detach()
