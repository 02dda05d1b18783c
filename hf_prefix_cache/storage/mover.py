"""Moving a stored segment's tensors between the device and host memory: the `Mover` and the segment copies.

The device and host tiers (`memory.py`) keep a segment as a run of its own: `segment_to_host`
and `segment_to_device` copy the segment's range of keys/values, its snapshots and its item
states and return a new `Segment`; the caller swaps it into the tree and releases the old one. On
CUDA the copy to host runs on a side stream so decoding on the default stream is not stalled; the
new run carries a `wait` that blocks until the copy is done, called before anything reads it.
Host copies lay each layer's keys beside its values, so a run comes back by blocks of layers
(`to_device_by_layer`) and carries a `Landing` (`model/landing.py`): a prefill waits per layer,
any other reader for all of it.

Knows tensors and devices; nothing about trees or models.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TypeVar

import torch

from hf_prefix_cache.model.landing import DeferredCopies, Landing, StreamEvents, combine
from hf_prefix_cache.model.layers import LayerState
from hf_prefix_cache.model.runs import Run
from hf_prefix_cache.model.states import Snapshot
from hf_prefix_cache.storage.host_pool import HostPool
from hf_prefix_cache.storage.segments import Segment

S = TypeVar("S", bound=Snapshot)
T = TypeVar("T")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is an allocator's out-of-memory error (CUDA, or pinned host memory)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


class Mover:
    """Copies tensors between a model's devices and host memory, one batched copy per call and device.

    `to_host` lays the tensors of one call out in one buffer from a `HostPool` (page-locked with
    `pin`, reused, never allocated per move): on CUDA they are gathered into one device buffer by
    one multi-tensor copy and that buffer goes to the host in one copy, on a side stream with
    `use_streams`. `to_device` brings tensors that share one host buffer back in one copy of
    their byte span, and returns views of the device copy.

    Args:
        pin: put host copies in page-locked memory (only meaningful with CUDA).
        use_streams: copy device -> host on a side stream per CUDA device.
        reuse: take host buffers from a reusing pool (default: with `pin`, as `HostPool` decides).
    """

    def __init__(self, pin: bool = False, use_streams: bool = False, reuse: bool | None = None) -> None:
        self.pin = pin
        self.use_streams = use_streams
        self.pool = HostPool(pin, reuse)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def to_host(
        self, tensors: Sequence[torch.Tensor | None]
    ) -> tuple[list[torch.Tensor | None], Callable[[], None] | None]:
        """Copies of `tensors` in host memory, and a `wait` to call before reading them (or None)."""
        out: list[torch.Tensor | None] = [None] * len(tensors)
        events: list[torch.cuda.Event] = []
        for device, members in _by_device(tensors, [None] * len(tensors)).items():
            srcs = [tensors[i].detach() for i in members]  # type: ignore[union-attr]
            offsets, nbytes = _layout(srcs)
            buffer = self.pool.take(nbytes)
            views = [_view(buffer, offset, t) for offset, t in zip(offsets, srcs, strict=True)]
            if device.type == "cuda":
                events.extend(self._from_cuda(device, buffer, offsets, srcs))
            else:
                with torch.no_grad():
                    torch._foreach_copy_(views, srcs)
            for i, view in zip(members, views, strict=True):
                out[i] = view
        if not events:
            return out, None

        def wait() -> None:
            for event in events:
                event.synchronize()

        return out, wait

    def _from_cuda(
        self, device: torch.device, buffer: torch.Tensor, offsets: list[int], srcs: list[torch.Tensor]
    ) -> list[torch.cuda.Event]:  # pragma: no cover - CUDA only
        """Gather `srcs` into one device buffer and copy it into `buffer` (on the side stream with `use_streams`)."""
        current = torch.cuda.current_stream(device)
        stream = self._stream(device) if self.use_streams else current
        stream.wait_stream(current)
        with torch.cuda.stream(stream), torch.no_grad():
            staging = torch.empty(buffer.numel(), dtype=torch.uint8, device=device)
            torch._foreach_copy_([_view(staging, o, t) for o, t in zip(offsets, srcs, strict=True)], srcs)
            buffer.copy_(staging, non_blocking=self.pin and self.use_streams)
        if stream is current:
            return []
        for t in srcs:
            t.record_stream(stream)  # the allocator must not reuse a source's memory before the copy ends
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        self.pool.fence(buffer, event.query)  # dropped before the copy ends, the buffer must still not be reused
        return [event]

    def to_device(
        self, tensors: Sequence[torch.Tensor | None], devices: Sequence[torch.device | None]
    ) -> list[torch.Tensor | None]:
        """Copies of host `tensors` on their `devices` (ordered on each device's current stream)."""
        out: list[torch.Tensor | None] = [None] * len(tensors)
        for device, members in _by_device(tensors, devices).items():
            srcs = [tensors[i] for i in members]
            span = _shared_span(srcs)  # type: ignore[arg-type]
            if span is None:
                moved = [t.to(device, non_blocking=t.is_pinned(), copy=True) for t in srcs]  # type: ignore[union-attr]
            else:
                flat, lo, starts = span
                copy = flat.to(device, non_blocking=flat.is_pinned(), copy=True)
                if flat.is_pinned() and device.type == "cuda":  # pragma: no cover - CUDA only
                    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    event.record(torch.cuda.current_stream(device))
                    self.pool.fence(flat, event.query)  # the host buffer is read until the copy ends
                moved = [_view(copy, start - lo, t) for start, t in zip(starts, srcs, strict=True)]  # type: ignore[arg-type]
            for i, t in zip(members, moved, strict=True):
                out[i] = t
        return out

    def to_device_by_layer(
        self, tensors: Sequence[torch.Tensor | None], devices: Sequence[torch.device | None], layers: Sequence[int]
    ) -> tuple[list[torch.Tensor | None], Landing | None]:
        """Copies of host `tensors` on their `devices`, landing by blocks of `layers` (`layers[i]` holds `tensors[i]`).

        The reader calls `ready(layer)` on the landing before it reads a layer's copies, or
        `ready_all()`; the copies of later layers then overlap the work on earlier ones. From
        page-locked memory to CUDA they run on a side stream (`StreamEvents`); to other devices
        each block is copied at its first `ready` (`DeferredCopies`), so a read that forgot to
        wait finds unwritten memory there too. Tensors that do not tile one host span in layer
        order (a part of a longer run, a file just read) are copied at once, as `to_device` does.
        """
        out: list[torch.Tensor | None] = [None] * len(tensors)
        landings: list[Landing] = []
        for device, members in _by_device(tensors, devices).items():
            srcs: list[torch.Tensor] = [tensors[i] for i in members]  # type: ignore[misc]
            span = _shared_span(srcs)
            blocks = _layer_blocks(srcs, [layers[i] for i in members]) if span is not None else None
            eager = span is None or blocks is None or (device.type == "cuda" and not span[0].is_pinned())
            if eager:
                moved = self.to_device(srcs, [device] * len(srcs))
            else:
                assert span is not None and blocks is not None
                flat, lo, starts = span
                block_of, ranges = blocks
                copy = torch.empty(flat.numel(), dtype=torch.uint8, device=device)
                if device.type == "cuda":  # pragma: no cover - CUDA only
                    landings.append(self._land_on_stream(device, flat, copy, ranges, block_of))
                else:
                    copy.fill_(255)  # NaN in every float dtype until its block lands
                    landings.append(
                        DeferredCopies(block_of, [partial(_copy_range, copy, flat, a, b) for a, b in ranges])
                    )
                moved = [_view(copy, start - lo, t) for start, t in zip(starts, srcs, strict=True)]
            for i, t in zip(members, moved, strict=True):
                out[i] = t
        return out, combine(landings)

    def _land_on_stream(
        self,
        device: torch.device,
        flat: torch.Tensor,
        copy: torch.Tensor,
        ranges: list[tuple[int, int]],
        block_of: dict[int, int],
    ) -> Landing:  # pragma: no cover - CUDA only
        """Queue the block copies of pinned `flat` into device `copy` on the side stream, an event after each."""
        current = torch.cuda.current_stream(device)
        stream = self._stream(device)
        stream.wait_stream(current)  # `copy` was allocated on the current stream; its memory may still be read there
        events = []
        with torch.cuda.stream(stream):
            for a, b in ranges:
                copy[a:b].copy_(flat[a:b], non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
                events.append(event)
        copy.record_stream(stream)  # freed before the copies end, its memory must not be handed out again
        self.pool.fence(flat, events[-1].query)  # the host buffer is read until the last copy ends
        return StreamEvents(block_of, device, events)

    def _stream(self, device: torch.device) -> torch.cuda.Stream:  # pragma: no cover - CUDA only
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return stream


def _by_device(
    tensors: Sequence[torch.Tensor | None], devices: Sequence[torch.device | None]
) -> dict[torch.device, list[int]]:
    """Indices of the present `tensors` by the device they go to (their own where `devices` says None)."""
    groups: dict[torch.device, list[int]] = {}
    for i, (t, device) in enumerate(zip(tensors, devices, strict=True)):
        if t is not None:
            groups.setdefault(device if device is not None else t.device, []).append(i)
    return groups


def _layout(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Byte offsets of `tensors` laid out one after another in one buffer, and its size.

    Each starts at a multiple of its element size, so tensors of one dtype (an entry's keys and
    values) leave no gap: the buffer holds exactly their bytes.
    """
    offsets, end = [], 0
    for t in tensors:
        end = -(-end // t.element_size()) * t.element_size()
        offsets.append(end)
        end += t.nbytes
    return offsets, end


def _view(buffer: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The tensor of `like`'s dtype and shape at byte `offset` of uint8 `buffer`, contiguous."""
    return buffer[offset : offset + like.nbytes].view(like.dtype).view(like.shape)


_MAX_BLOCKS = 16  # copies per device for a run brought back by layer: fewer launches, still overlapping


def _layer_blocks(
    tensors: Sequence[torch.Tensor], layers: Sequence[int]
) -> tuple[dict[int, int], list[tuple[int, int]]] | None:
    """For `tensors` tiling one byte span: the copy block of each layer, and each block's byte range in the span.

    Layers are grouped into at most `_MAX_BLOCKS` blocks of consecutive layers. None when the
    layers do not follow the bytes' order (a layout from before the per-layer order), so that a
    block would not be one range.
    """
    starts = [int(t.storage_offset()) * t.element_size() for t in tensors]
    order = sorted(range(len(tensors)), key=starts.__getitem__)
    in_order = [layers[i] for i in order]
    if any(b < a for a, b in zip(in_order, in_order[1:], strict=False)):
        return None
    distinct = sorted(set(in_order))
    per_block = -(-len(distinct) // _MAX_BLOCKS)
    block_of = {layer: n // per_block for n, layer in enumerate(distinct)}
    lo = starts[order[0]]
    ranges: list[tuple[int, int]] = []
    for i in order:
        a, b = starts[i] - lo, starts[i] - lo + int(tensors[i].nbytes)
        if len(ranges) == block_of[layers[i]]:
            ranges.append((a, b))
        else:
            ranges[-1] = (ranges[-1][0], b)
    return block_of, ranges


def _copy_range(dst: torch.Tensor, src: torch.Tensor, a: int, b: int) -> None:
    dst[a:b].copy_(src[a:b])


def _shared_span(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, int, list[int]] | None:
    """When contiguous `tensors` tile one byte span of one storage (as `to_host` lays them out): the span, its
    start and theirs. Tensors with gaps between them (a part of a longer host run) are not copied this way: the
    device copy would hold bytes nobody counts."""
    first = tensors[0].untyped_storage()
    if not all(t.is_contiguous() and t.untyped_storage().data_ptr() == first.data_ptr() for t in tensors):
        return None
    starts = [int(t.storage_offset()) * t.element_size() for t in tensors]
    ends = sorted((s, s + int(t.nbytes)) for s, t in zip(starts, tensors, strict=True))
    if any(a_end != b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:], strict=False)):
        return None
    lo, hi = ends[0][0], ends[-1][1]
    whole = torch.empty(0, dtype=torch.uint8, device=tensors[0].device).set_(first)
    return whole[lo:hi], lo, starts


def segment_to_host(seg: Segment, mover: Mover) -> Segment:
    """A copy of `seg` (its key/value range and snapshots) in host memory, on a run of its own."""
    assert seg.disk is None, "segment_to_host takes a segment in memory"
    run = None
    if seg.run is not None:
        keys, values = seg.run.slice(seg.start, seg.end)
        # One batched copy for the whole entry, each layer's keys beside its values (it comes back by layer).
        moved, wait = mover.to_host(_by_layer(keys, values))
        run = Run(moved[0::2], moved[1::2], seg.start, seg.end, devices=list(seg.run.devices))
        run.wait = wait
        run.take()
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
        layers = [i for i in range(len(keys)) for _ in (0, 1)]
        moved, landing = mover.to_device_by_layer(_by_layer(keys, values), _by_layer(seg.run.devices), layers)
        run = Run(moved[0::2], moved[1::2], seg.start, seg.end, devices=list(seg.run.devices))
        run.landing = landing
        run.take()
    snapshots = {n: _snapshot_to(snap, mover, state_devices) for n, snap in seg.snapshots.items()}
    items = {n: _snapshot_to(state, mover, state_devices) for n, state in seg.items.items()}
    return Segment(run, seg.start, seg.end, seg.nbytes_per_token, snapshots, items=items)


def _by_layer(keys: Sequence[T], values: Sequence[T] | None = None) -> list[T]:
    """`keys[0], values[0], keys[1], values[1], ...` (each layer's pair side by side; `values` defaults to `keys`)."""
    return [x for pair in zip(keys, keys if values is None else values, strict=True) for x in pair]


def snapshot_to_host(snap: S, mover: Mover) -> S:
    """A copy of `snap` in host memory (finished: snapshots are small)."""
    return _snapshot_to(snap, mover, None)


def _snapshot_to(snap: S, mover: Mover, devices: dict[int, torch.device | None] | None) -> S:
    """`snap` moved whole: every tensor of every layer in one batched copy per device."""
    where = [
        (layer, name, i) for layer, state in snap.states.items() for name, per in state.tensors.items() for i in per
    ]
    tensors = [snap.states[layer].tensors[name][i] for layer, name, i in where]
    if devices is None:
        moved, wait = mover.to_host(tensors)
        if wait is not None:  # snapshots are small; finish their copies now
            wait()
    else:
        moved = mover.to_device(tensors, [devices.get(layer) for layer, _, _ in where])
    states = {
        layer: LayerState(
            tensors={name: {} for name in state.tensors}, flags={k: dict(v) for k, v in state.flags.items()}
        )
        for layer, state in snap.states.items()
    }
    for (layer, name, i), t in zip(where, moved, strict=True):
        states[layer].tensors[name][i] = t
    return type(snap)(snap.length, states, snap.nbytes, snap.reach)
