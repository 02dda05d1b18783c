"""Where a stored segment's tensors live, and moving them between the device, host memory and disk.

Three tiers, fastest first: `DEVICE` (the model's devices, each layer's tensors on its own
layer's device), `HOST` (CPU memory, page-locked when the model runs on CUDA, so copies can be
asynchronous) and `DISK` (one safetensors file per segment, written by `disk.py`).

A segment that leaves a tier gets a run of its own in the new place: `segment_to_host` and
`segment_to_device` copy the segment's range of keys/values, its snapshots and its item states
and return a new `Segment`; the caller swaps it into the tree and releases the old one. On CUDA
the copy to host runs on a side stream so decoding on the default stream is not stalled; the new
run carries a `wait` that blocks until the copy is done, called before anything reads it.

Knows tensors and devices; nothing about trees or models.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from hf_prefix_cache.model.layers import LayerState
from hf_prefix_cache.model.states import Run, Snapshot
from hf_prefix_cache.storage.segments import Segment

S = TypeVar("S", bound=Snapshot)

DEVICE, HOST, DISK = 0, 1, 2
TIER_NAMES = ("device", "host", "disk")
NUM_TIERS = len(TIER_NAMES)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is an allocator's out-of-memory error (CUDA, or pinned host memory)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


class Mover:
    """Copies tensors between a model's devices and host memory.

    Args:
        pin: put host copies in page-locked memory (only meaningful with CUDA).
        use_streams: copy device -> host on a side stream per CUDA device.
    """

    def __init__(self, pin: bool = False, use_streams: bool = False) -> None:
        self.pin = pin
        self.use_streams = use_streams
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def to_host(
        self, tensors: Sequence[torch.Tensor | None]
    ) -> tuple[list[torch.Tensor | None], Callable[[], None] | None]:
        """Copies of `tensors` in host memory, and a `wait` to call before reading them (or None)."""
        out: list[torch.Tensor | None] = []
        events: list[torch.cuda.Event] = []
        for t in tensors:
            if t is None:
                out.append(None)
                continue
            if t.device.type != "cuda":
                out.append(t.detach().to("cpu", copy=True).contiguous())
                continue
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin)
            if self.use_streams:
                stream = self._stream(t.device)
                stream.wait_stream(torch.cuda.current_stream(t.device))
                with torch.cuda.stream(stream):
                    host.copy_(t, non_blocking=self.pin)
                t.record_stream(stream)  # the allocator must not reuse t's memory before the copy ends
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
                events.append(event)
            else:
                host.copy_(t)
            out.append(host)
        if not events:
            return out, None

        def wait() -> None:
            for event in events:
                event.synchronize()

        return out, wait

    def to_device(
        self, tensors: Sequence[torch.Tensor | None], devices: Sequence[torch.device | None]
    ) -> list[torch.Tensor | None]:
        """Copies of host `tensors` on their `devices` (ordered on each device's current stream)."""
        out: list[torch.Tensor | None] = []
        for t, device in zip(tensors, devices, strict=True):
            if t is None:
                out.append(None)
            elif device is None or device == t.device:
                out.append(t.clone())
            else:
                out.append(t.to(device, non_blocking=t.is_pinned()))
        return out

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return stream


def segment_to_host(seg: Segment, mover: Mover) -> Segment:
    """A copy of `seg` (its key/value range and snapshots) in host memory, on a run of its own."""
    assert seg.disk is None, "segment_to_host takes a segment in memory"
    run = None
    if seg.run is not None:
        keys, values = seg.run.slice(seg.start, seg.end)
        host_keys, wait_k = mover.to_host(keys)
        host_values, wait_v = mover.to_host(values)
        run = Run(host_keys, host_values, seg.start, seg.end, devices=list(seg.run.devices))
        run.wait = _both(wait_k, wait_v)
        run.num_refs = 1
    snapshots = {n: snapshot_to_host(snap, mover) for n, snap in seg.snapshots.items()}
    items = {n: snapshot_to_host(state, mover) for n, state in seg.items.items()}
    return Segment(run, seg.start, seg.end, seg.nbytes_per_token, snapshots, items=items)


def segment_to_device(seg: Segment, mover: Mover, state_devices: dict[int, torch.device | None]) -> Segment:
    """A copy of host segment `seg` on the devices its layers belong to, on a run of its own.

    `state_devices` maps a stateful (or item-state) layer to its device (snapshots do not remember one).
    """
    assert seg.disk is None, "load a disk segment before moving it to the device"
    run = None
    if seg.run is not None:
        keys, values = seg.run.slice(seg.start, seg.end)
        run = Run(
            mover.to_device(keys, seg.run.devices),
            mover.to_device(values, seg.run.devices),
            seg.start,
            seg.end,
            devices=list(seg.run.devices),
        )
        run.num_refs = 1
    snapshots = {n: _snapshot_to(snap, mover, state_devices) for n, snap in seg.snapshots.items()}
    items = {n: _snapshot_to(state, mover, state_devices) for n, state in seg.items.items()}
    return Segment(run, seg.start, seg.end, seg.nbytes_per_token, snapshots, items=items)


def snapshot_to_host(snap: S, mover: Mover) -> S:
    """A copy of `snap` in host memory (finished: snapshots are small)."""
    return _snapshot_to(snap, mover, None)


def _snapshot_to(snap: S, mover: Mover, devices: dict[int, torch.device | None] | None) -> S:
    states: dict[int, LayerState] = {}
    waits: list[Callable[[], None]] = []
    for layer, state in snap.states.items():
        tensors: dict[str, dict[int, torch.Tensor | None]] = {}
        for name, per_idx in state.tensors.items():
            idx = list(per_idx)
            if devices is None:
                moved, wait = mover.to_host([per_idx[i] for i in idx])
                if wait is not None:
                    waits.append(wait)
            else:
                moved = mover.to_device([per_idx[i] for i in idx], [devices.get(layer)] * len(idx))
            tensors[name] = dict(zip(idx, moved, strict=True))
        states[layer] = LayerState(tensors=tensors, flags={k: dict(v) for k, v in state.flags.items()})
    for wait in waits:  # snapshots are small; finish their copies now
        wait()
    return type(snap)(snap.length, states, snap.nbytes, snap.reach)


def _both(a: Callable[[], None] | None, b: Callable[[], None] | None) -> Callable[[], None] | None:
    if a is None or b is None:
        return a or b

    def wait() -> None:
        a()
        b()

    return wait
