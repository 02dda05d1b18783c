"""Random text conversations through every supported cache layer type equal their cold runs,
and never reuse more than the longest stored prefix; attention-only models reuse exactly that.

Prompts are built from a pool of four token ids, so they share prefixes often and diverge at
arbitrary points (inside stored entries, at snapshot boundaries, inside sliding windows), and
requests may continue the previous answer as a chat turn. Models with recurrent layers reuse
only up to a snapshot, so for them the longest stored prefix is an upper bound.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import assert_same_as_cold, cached_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import FULL_ATTENTION, HYBRID, RECURRENT, SLIDING

from hf_prefix_cache import PrefixCache

NEW = 3
ATTENTION = FULL_ATTENTION + SLIDING

_pieces = st.lists(st.integers(4, 7), min_size=1, max_size=12)
_requests = st.lists(st.tuples(st.lists(_pieces, min_size=1, max_size=3), st.booleans()), min_size=1, max_size=4)


@pytest.mark.parametrize("name", ATTENTION + HYBRID + RECURRENT)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversation=_requests)
def test_random_conversations_are_exact(name: str, conversation: list[Any]) -> None:
    model = cached_model(name)
    store = PrefixCache(model, snapshot_interval=8)
    stored: list[list[int]] = []
    previous: list[int] = []
    try:
        for new_pieces, continues in conversation:
            ids = list(previous) if continues else []
            for piece in new_pieces:
                ids += piece
            longest = 0
            for seq in stored:
                n = 0
                while n < min(len(seq), len(ids)) and seq[n] == ids[n]:
                    n += 1
                longest = max(longest, n)
            bound = min(longest, len(ids) - 1)
            before = store.stats().hit_tokens
            out = assert_same_as_cold(model, torch.tensor([ids]), store, new=NEW)
            reused = store.stats().hit_tokens - before
            if name in ATTENTION:
                assert reused == bound
            else:
                assert reused <= bound
            sequence = out.sequences[0].tolist()
            stored.append(sequence[:-1])
            previous = sequence
        assert not store.stats().fallbacks, store.stats().fallbacks
        store.check_integrity()
    finally:
        store.detach()
