"""The tiers in memory: `DeviceTier` (each layer's tensors on its own layer's device) and `HostTier` (CPU memory).

Both keep a segment as a run of its own, copied by a `Mover` (`tiers.py`: batched copies, on
CUDA page-locked and on a side stream), and give back a segment's share of its run on `drop`.
States computed after a segment was kept (snapshots and media item states a new path brings)
join it on its tier through `add_states`.

Knows segments and devices; nothing about the tree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hf_prefix_cache.model.states import ItemState, Snapshot
from hf_prefix_cache.storage.mover import Mover, segment_to_device, segment_to_host, snapshot_to_host
from hf_prefix_cache.storage.segments import Segment
from hf_prefix_cache.storage.tier import Place


class _InMemory:
    """What both memory tiers do alike: a segment kept in memory is read as it is and gives its run back."""

    def get(self, seg: Segment, place: Place) -> Segment:
        return seg

    def drop(self, seg: Segment) -> None:
        """`seg` no longer reads its run: the run is cut down to what other segments still read."""
        if seg.run is not None:
            seg.run.give_back(seg.start, seg.end)

    def flush(self) -> None:
        """Nothing was left for later: copies are made by `put` itself."""


class DeviceTier(_InMemory):
    """The model's devices: where restores read from; `state_device(layer)` is where a stateful layer's states go.

    Example:
        >>> from hf_prefix_cache.model.runs import Run
        >>> from hf_prefix_cache.storage.tier import Standalone
        >>> run = Run([torch.ones(1, 1, 4, 2)], [torch.zeros(1, 1, 4, 2)], 0, 4)
        >>> host = HostTier(Mover()).put(Segment(run, 0, 4, run.nbytes_per_token), Standalone("ns", (1, 2, 3, 4)))
        >>> back = DeviceTier(Mover(), lambda layer: None).put(host, Standalone("ns", (1, 2, 3, 4)))
        >>> (back.start, back.end), back.run is not host.run  # a run of its own (landing by layer: `run.landing`)
        ((0, 4), True)
    """

    name = "device"

    def __init__(self, mover: Mover, state_device: Callable[[int], torch.device | None]) -> None:
        self.mover = mover
        self.state_device = state_device

    def put(self, seg: Segment, place: Place) -> Segment:
        """A copy of host segment `seg` on the devices its layers belong to."""
        return segment_to_device(seg, self.mover, self.state_devices(seg))

    def add_states(self, seg: Segment, snapshots: Sequence[Snapshot], items: Sequence[ItemState]) -> None:
        """Give `seg` (one this tier keeps) device `snapshots` and media `items` as they are."""
        _add_states(seg, snapshots, items)

    def holds_as_is(self, seg: Segment) -> bool:
        """Whether in-memory `seg` already lies where this tier keeps it: every layer it holds lives on the CPU."""
        targets = [*(seg.run.devices if seg.run is not None else []), *self.state_devices(seg).values()]
        return all(d is None or d.type == "cpu" for d in targets)

    def state_devices(self, seg: Segment) -> dict[int, torch.device | None]:
        """The device of each layer whose states `seg`'s snapshots and item states hold."""
        held = [*seg.snapshots.values(), *seg.items.values()]
        return {layer: self.state_device(layer) for snap in held for layer in snap.states}


class HostTier(_InMemory):
    """CPU memory (page-locked with a pinning `Mover`); a segment here comes back to the device by layer."""

    name = "host"

    def __init__(self, mover: Mover) -> None:
        self.mover = mover

    def put(self, seg: Segment, place: Place) -> Segment:
        """A copy of in-memory `seg` in host memory."""
        return segment_to_host(seg, self.mover)

    def add_states(self, seg: Segment, snapshots: Sequence[Snapshot], items: Sequence[ItemState]) -> None:
        """Give `seg` (one this tier keeps) copies of device `snapshots` and media `items` in host memory."""
        mover = self.mover
        _add_states(seg, [snapshot_to_host(s, mover) for s in snapshots], [snapshot_to_host(s, mover) for s in items])


def _add_states(seg: Segment, snapshots: Sequence[Snapshot], items: Sequence[ItemState]) -> None:
    """`seg` takes each of `snapshots` and `items` at its length (the caller picked ones it holds none at)."""
    for snap in snapshots:
        seg.snapshots[snap.length] = snap
    for state in items:
        seg.items[state.length] = state
