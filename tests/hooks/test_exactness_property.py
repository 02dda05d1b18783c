"""Random text conversations through every supported cache layer type equal their cold runs,
and never reuse more than the longest stored prefix; attention-only models reuse exactly that.

Prompts are built from a pool of four token ids, so they share prefixes often and diverge at
arbitrary points (inside stored entries, at snapshot boundaries, inside sliding windows), and
requests may continue the previous answer as a chat turn. Models with recurrent layers reuse
only up to a snapshot, so for them the longest stored prefix is an upper bound.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
from conftest import assert_same_as_cold, cached_model, generate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.reference import longest_prefix
from hf_prefix_cache.testing.tiny_models import FULL_ATTENTION, HYBRID, RECURRENT, SLIDING

NEW = 3
ATTENTION = FULL_ATTENTION + SLIDING

_pieces = st.lists(st.integers(4, 7), min_size=1, max_size=12)
_requests = st.lists(st.tuples(st.lists(_pieces, min_size=1, max_size=3), st.booleans()), min_size=1, max_size=4)


@pytest.mark.parametrize("name", ATTENTION + HYBRID + RECURRENT)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversation=_requests)
def test_random_conversations_are_exact(name: str, conversation: list[Any]) -> None:
    _converse(name, conversation, pressure=False)


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2", "bamba", "jamba", "mamba2", "mamba"])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversation=_requests)
def test_under_memory_pressure_reuse_stays_exact(name: str, conversation: list[Any]) -> None:
    """About 20 tokens' worth of memory and 40 of disk: entries and snapshots are split, moved to
    disk, reloaded and dropped between requests, and every request still equals its cold run."""
    _converse(name, conversation, pressure=True)


@pytest.mark.parametrize("name", SLIDING)
@pytest.mark.parametrize("pressure", [False, True])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversation=_requests)
def test_windowed_sliding_layers_stay_exact(name: str, pressure: bool, conversation: list[Any]) -> None:
    """With sliding layers stored as windows at snapshot points, random chats (and the same under
    memory pressure, entries moving to disk and back) equal their cold runs."""
    _converse(name, conversation, pressure=pressure, sliding_window_mode="window")


def _converse(name: str, conversation: list[Any], pressure: bool, sliding_window_mode: str = "every_position") -> None:
    model = cached_model(name)
    folder = tempfile.TemporaryDirectory()
    if pressure:
        # What 20 tokens with their snapshots take, from one request through a roomy store.
        sizing = PrefixCache(model, snapshot_interval=8, sliding_window_mode=sliding_window_mode)
        try:
            generate(model, torch.tensor([[4] * 20]), 1, past_key_values=sizing)
            unit = max(sizing.stats().nbytes, 1)
        finally:
            sizing.detach()
        store = PrefixCache(
            model,
            snapshot_interval=8,
            max_bytes=unit,
            disk_dir=folder.name,
            max_disk_bytes=2 * unit,
            save_on_exit=False,
            sliding_window_mode=sliding_window_mode,
        )
    else:
        store = PrefixCache(model, snapshot_interval=8, sliding_window_mode=sliding_window_mode)
    stored: list[list[int]] = []
    previous: list[int] = []
    try:
        for new_pieces, continues in conversation:
            ids = list(previous) if continues else []
            for piece in new_pieces:
                ids += piece
            bound = min(longest_prefix(stored, ids), len(ids) - 1)
            before = store.stats().hit_tokens
            out = assert_same_as_cold(model, torch.tensor([ids]), store, new=NEW)
            reused = store.stats().hit_tokens - before
            if name in ATTENTION and not pressure and sliding_window_mode == "every_position":
                assert reused == bound
            else:
                assert reused <= bound
            sequence = out.sequences[0].tolist()
            stored.append(sequence[:-1])
            previous = sequence
        assert set(store.stats().fallbacks) <= ({"entry_over_budget"} if pressure else set()), store.stats().fallbacks
        store.check_integrity()
    finally:
        store.detach()
        folder.cleanup()


_rows = st.integers(4, 20).flatmap(
    lambda n: st.lists(st.lists(st.integers(4, 6), min_size=n, max_size=n), min_size=2, max_size=3)
)


@pytest.mark.parametrize("name", ATTENTION)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches=st.lists(_rows, min_size=1, max_size=3))
def test_random_batches_are_exact(name: str, batches: list[list[list[int]]]) -> None:
    """Batches of equal-length rows (no padding) reuse, in every row, its own stored prefix up to the column
    all rows reach, exactly."""
    model = cached_model(name)
    store = PrefixCache(model)
    stored: list[list[int]] = []
    try:
        for rows in batches:
            limit = len(rows[0]) - 1  # never the last token, fed for its logits
            own = [min(limit, longest_prefix(stored, row)) for row in rows]
            reach = min(own)
            before, layout_before = store.stats().hit_tokens, store.stats().fallbacks.get("batch_layout", 0)
            out = assert_same_as_cold(model, torch.tensor(rows), store, new=NEW)
            # Counted per row: every row reuses its own stored prefix up to the column all of them reach.
            assert store.stats().hit_tokens - before == len(rows) * reach
            # A row that had more stored than that column says so (`batch_layout`); a batch that lost none does not.
            lost = store.stats().fallbacks.get("batch_layout", 0) - layout_before
            assert lost == (1 if len(rows) > 1 and max(own) > reach else 0), (own, reach, lost)
            stored += [seq[:-1] for seq in out.sequences.tolist()]
        assert set(store.stats().fallbacks) <= {"batch_layout"}, store.stats().fallbacks
        store.check_integrity()
    finally:
        store.detach()
