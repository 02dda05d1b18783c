"""Every local tier speaks the one `Tier` protocol: put a segment, get it back equal, drop it and hold nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_prefix_cache.model.runs import Run
from hf_prefix_cache.storage.codec import Layout
from hf_prefix_cache.storage.disk import DiskTier
from hf_prefix_cache.storage.mover import Mover
from hf_prefix_cache.storage.segments import Segment
from hf_prefix_cache.storage.tier import Off, Standalone
from hf_prefix_cache.storage.tiers import DISK, TIER_NAMES, TierParts, make_tiers

LAYOUT = Layout(num_layers=2, kv_layers=(0, 1), state_layers=())


def _segment() -> Segment:
    keys = [torch.randn(1, 2, 6, 4, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    values = [torch.randn(1, 2, 6, 4, generator=torch.Generator().manual_seed(10 + i)) for i in range(2)]
    run = Run(keys, values, 0, 6)
    run.take()
    return Segment(run, 0, 6, run.nbytes_per_token)


def test_the_tier_list_is_data_in_order() -> None:
    """The local tiers are one list, fastest first, and each made tier carries its own name."""
    tiers = make_tiers(TierParts(Mover(), lambda layer: None, LAYOUT))
    assert TIER_NAMES == ("device", "host", "disk")
    assert tuple(tier.name for tier in tiers) == TIER_NAMES
    assert isinstance(tiers[DISK], Off)  # no disk folder: the disk tier is off


@pytest.mark.parametrize("name", ["device", "host", "disk"])
def test_put_get_drop_round_trip(name: str, tmp_path: Path) -> None:
    """A segment put on a tier comes back equal from `get`, on a run or file of its own that `drop` and `flush` give back."""
    tiers = make_tiers(TierParts(Mover(), lambda layer: None, LAYOUT, tmp_path))
    tier = tiers[TIER_NAMES.index(name)]
    original = _segment()
    assert original.run is not None
    want_keys, want_values = original.run.slice(0, 6)
    place = Standalone("ns", (1, 2, 3, 4, 5, 6))
    kept = tier.put(original, place)
    assert kept is not None and (kept.start, kept.end, kept.nbytes) == (0, 6, original.nbytes)
    back = tier.get(kept, place)
    assert back.run is not None and back.run is not original.run
    keys, values = back.run.slice(0, 6)
    for got, want in zip([*keys, *values], [*want_keys, *want_values], strict=True):
        assert got is not None and want is not None and torch.equal(got, want)
    files = sorted((tmp_path / "ns").glob("*.safetensors")) if name == "disk" else []
    assert len(files) == (1 if name == "disk" else 0)
    tier.drop(kept)
    tier.flush()  # what a tier leaves for after the store's lock (the disk tier's deletions) is done now
    if name == "disk":
        assert isinstance(tier, DiskTier)
        assert not any((tmp_path / "ns").glob("*.safetensors"))
    else:
        assert kept.run is not None and kept.run.num_refs == 0
