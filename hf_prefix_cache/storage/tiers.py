"""The local tiers, fastest first, as data: a stored node's tier is its index in `TIERS`.

    device (`memory.DeviceTier`) -> host (`memory.HostTier`) -> disk (`disk.DiskTier`)

Each row is a tier's class (its `name` is what users see) and how it is made from the parts a
store has (`TierParts`). A new local tier is its module (a `Tier`, see `tier.py`) and one row
here, at its place in the order; the placement policy (`store/placement.py`) moves nodes down
and back by index. The remote tier (`remote.py`) is below them all and holds no tree nodes, so it
is not a row.

Knows the tiers' classes; nothing about the tree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_prefix_cache.storage.codec import Layout
from hf_prefix_cache.storage.disk import DiskTier
from hf_prefix_cache.storage.memory import DeviceTier, HostTier
from hf_prefix_cache.storage.mover import Mover
from hf_prefix_cache.storage.tier import Off, Tier


@dataclass(frozen=True, slots=True)
class TierParts:
    """What the tiers are made of: the copier, where stateful layers live, the model's layout, the disk folder."""

    mover: Mover
    state_device: Callable[[int], torch.device | None]
    layout: Layout
    disk_root: Path | None = None


def _disk(parts: TierParts) -> Tier:
    return DiskTier(parts.disk_root, parts.layout) if parts.disk_root is not None else Off(DiskTier.name)


#: The local tiers, fastest first: (the tier's class, how it is made).
TIERS: tuple[tuple[type[Tier], Callable[[TierParts], Tier]], ...] = (
    (DeviceTier, lambda parts: DeviceTier(parts.mover, parts.state_device)),
    (HostTier, lambda parts: HostTier(parts.mover)),
    (DiskTier, _disk),
)

TIER_NAMES: tuple[str, ...] = tuple(kind.name for kind, _ in TIERS)
DEVICE, HOST, DISK = (TIER_NAMES.index(kind.name) for kind in (DeviceTier, HostTier, DiskTier))


def make_tiers(parts: TierParts) -> tuple[Tier, ...]:
    """The local tiers of one store, in `TIERS` order.

    >>> from hf_prefix_cache.storage.mover import Mover
    >>> tiers = make_tiers(TierParts(Mover(), lambda layer: None, Layout(1, (0,), ())))
    >>> [tier.name for tier in tiers]
    ['device', 'host', 'disk']
    """
    return tuple(make(parts) for _, make in TIERS)
