"""EncoderOutputs: keyed by namespace and input hash, bounded by bytes, least recently used dropped first."""

from __future__ import annotations

import pytest
import torch

from hf_prefix_cache.storage.encoder_outputs import EncoderOutputs


def output(n: int) -> torch.Tensor:
    """A `[1, n, 4]` float32 output: 16 bytes per position."""
    return torch.zeros(1, n, 4)


def test_an_output_is_found_only_under_its_namespace_and_hash() -> None:
    """Another hash or another namespace finds nothing."""
    store = EncoderOutputs(1000)
    hidden = output(2)
    assert store.put("ns", 7, hidden)
    assert store.get("ns", 7) is hidden
    assert store.get("ns", 8) is None and store.get("other", 7) is None
    assert store.hits == 1


def test_bytes_are_counted_and_the_least_recently_used_go_first() -> None:
    """Past the budget the output used longest ago is dropped; a `get` counts as a use."""
    store = EncoderOutputs(3 * 32)
    for digest in (1, 2, 3):
        assert store.put("ns", digest, output(2))
    assert store.nbytes == 96 and store.num_entries == 3
    store.get("ns", 1)
    store.put("ns", 4, output(2))
    assert store.get("ns", 2) is None
    assert all(store.get("ns", d) is not None for d in (1, 3, 4))
    assert store.nbytes == 96


def test_an_output_larger_than_the_budget_is_not_kept() -> None:
    """`put` refuses what alone exceeds the budget and keeps what was there."""
    store = EncoderOutputs(64)
    store.put("ns", 1, output(2))
    assert not store.put("ns", 2, output(5))
    assert store.get("ns", 1) is not None and store.nbytes == 32


def test_a_view_counts_its_whole_storage() -> None:
    """A slice of a larger tensor keeps all of it alive, so all of it is counted."""
    store = EncoderOutputs(10_000)
    store.put("ns", 1, output(10)[:, :2])
    assert store.nbytes == 160


def test_putting_the_same_key_again_replaces_it() -> None:
    """A second `put` of one key counts its bytes once."""
    store = EncoderOutputs(1000)
    store.put("ns", 1, output(2))
    store.put("ns", 1, output(3))
    assert store.num_entries == 1 and store.nbytes == 48


def test_shrinking_the_budget_drops_at_once_and_clear_empties() -> None:
    """Lowering `max_bytes` evicts down to it; `clear` drops everything."""
    store = EncoderOutputs(1000)
    for digest in range(4):
        store.put("ns", digest, output(2))
    store.max_bytes = 64
    assert store.num_entries == 2 and store.get("ns", 3) is not None
    store.clear()
    assert store.num_entries == 0 and store.nbytes == 0


def test_a_negative_budget_is_refused() -> None:
    """A negative budget raises `ValueError`."""
    with pytest.raises(ValueError, match="negative"):
        EncoderOutputs(-1)
    with pytest.raises(ValueError, match="negative"):
        EncoderOutputs(0).max_bytes = -1
