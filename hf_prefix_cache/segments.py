"""What a tree node holds: a range of keys/values in a shared run, plus state snapshots.

A `Run` owns the key/value tensors of consecutive positions `[lo, hi)` of one sequence, for
every layer that has keys. Nodes refer to sub-ranges of a run by absolute position, so a
prefix that lies in one run restores as a view with no copy, and a node split is free.

Invariant (checked by `PrefixCache.check_integrity`): the segments that refer to a run cover
`[lo, hi)` exactly, so the bytes of all segments add up to the bytes actually held. Whoever
drops a segment calls `Run.release`, which compacts the run when its referenced range shrinks.

A segment may also hold *item states*: tensors computed from one media item alone (Mllama:
an image's cross-attention keys/values), kept under the position after the item's
placeholder, so a prefix that contains the placeholder restores them with it.

A run lives on the model's devices (each layer's tensors on that layer's device) or in host
memory; a segment on disk has no run but a `DiskRef` to the file holding its range. Runs off
the device back exactly one tree node each until that node is split; `tiers.py` moves them.

Knows nothing about the tree or about models.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .layers import LayerState


class Run:
    """Keys/values `[B, H, hi - lo, D]` per attention layer (None for layers without keys).

    `devices` remembers where each layer's tensors belong, so a run brought back from host
    memory or disk goes to the device of its own layer (models split over several devices).
    `wait`, when set, blocks until an asynchronous copy into these tensors has finished.
    """

    __slots__ = ("devices", "hi", "keys", "lo", "nbytes_per_token", "num_refs", "values", "wait")

    def __init__(
        self,
        keys: list[torch.Tensor | None],
        values: list[torch.Tensor | None],
        lo: int,
        hi: int,
        devices: list[torch.device | None] | None = None,
        nbytes_per_token: int | None = None,
    ) -> None:
        self.keys = keys
        self.values = values
        self.lo = lo
        self.hi = hi
        self.num_refs = 0
        self.wait: Callable[[], None] | None = None
        self.devices = devices if devices is not None else [k.device if k is not None else None for k in keys]
        for k in keys:
            assert k is None or k.shape[-2] == hi - lo, f"run [{lo}, {hi}) given keys of {k.shape[-2]} positions"
        if nbytes_per_token is None:
            total = sum(t.nbytes for t in keys if t is not None) + sum(t.nbytes for t in values if t is not None)
            nbytes_per_token = total // max(hi - lo, 1)
        self.nbytes_per_token = nbytes_per_token

    @property
    def nbytes(self) -> int:
        return self.nbytes_per_token * (self.hi - self.lo)

    def slice(self, start: int, end: int) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Views of positions `[start, end)`."""
        assert self.lo <= start <= end <= self.hi, f"[{start}, {end}) outside run [{self.lo}, {self.hi})"
        if self.wait is not None:
            self.wait()
            self.wait = None
        a, b = start - self.lo, end - self.lo
        return (
            [k[..., a:b, :] if k is not None else None for k in self.keys],
            [v[..., a:b, :] if v is not None else None for v in self.values],
        )

    def compact(self, lo: int, hi: int) -> None:
        """Keep only `[lo, hi)`, copied into tensors of their own so the rest is freed."""
        keys, values = self.slice(lo, hi)
        self.keys = [k.clone() if k is not None else None for k in keys]
        self.values = [v.clone() if v is not None else None for v in values]
        self.lo, self.hi = lo, hi


@dataclass(slots=True)
class Snapshot:
    """Recurrent states of every stateful layer after exactly `length` tokens.

    A snapshot on disk keeps its length and size but no states (`states` is empty) until its
    segment is loaded back. A snapshot of window states only (sliding layers in window mode) may
    hold extended windows that also restore any length in `[length - reach, length]`.
    """

    length: int
    states: dict[int, LayerState]
    nbytes: int = -1
    reach: int = 0

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            self.nbytes = sum(s.nbytes for s in self.states.values())


@dataclass(slots=True)
class DiskRef:
    """A segment file holding positions `[lo, hi)`; `num_refs` segments read it (more than one after a split)."""

    path: Path
    lo: int
    hi: int
    devices: list[torch.device | None]
    num_refs: int = 1


@dataclass(slots=True)
class Segment:
    """The value of one tree node covering positions `[start, end)`.

    `snapshots` maps a length in `(start, end]` to the states after that many tokens.
    `items` maps the end of a media item's placeholder span in `(start, end]` to the states
    computed from that item alone (a `Snapshot` whose `length` is that end; its layers are the
    cross-attention layers). A segment on disk has `disk` set, no run, and snapshots and item
    states without tensors.
    """

    run: Run | None
    start: int
    end: int
    nbytes_per_token: int
    snapshots: dict[int, Snapshot] = field(default_factory=dict)
    disk: DiskRef | None = None
    items: dict[int, Snapshot] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        states = sum(s.nbytes for s in self.snapshots.values()) + sum(s.nbytes for s in self.items.values())
        return (self.end - self.start) * self.nbytes_per_token + states

    def split(self, offset: int) -> tuple[Segment, Segment]:
        at = self.start + offset
        head = Segment(
            self.run, self.start, at, self.nbytes_per_token, {n: s for n, s in self.snapshots.items() if n <= at}
        )
        tail = Segment(
            self.run, at, self.end, self.nbytes_per_token, {n: s for n, s in self.snapshots.items() if n > at}
        )
        head.disk = tail.disk = self.disk
        head.items = {n: s for n, s in self.items.items() if n <= at}
        tail.items = {n: s for n, s in self.items.items() if n > at}
        if self.run is not None:
            self.run.num_refs += 1  # one segment became two
        if self.disk is not None:
            self.disk.num_refs += 1
        return head, tail


KVPieces = list[tuple[list[torch.Tensor | None], list[torch.Tensor | None]]]


def kv_pieces(segments: Sequence[Segment], length: int) -> KVPieces:
    """Views of positions `[0, length)` from consecutive segments starting at 0, one per run.

    Segments that continue each other in one run merge into one view, so a prefix that lies in
    one run (the usual case) is a single piece. Empty for `length == 0` or segments without keys.
    """
    spans: list[tuple[Run, int, int]] = []
    for seg in segments:
        if seg.start >= length or seg.run is None:
            break
        end = min(seg.end, length)
        if spans and spans[-1][0] is seg.run and spans[-1][2] == seg.start:
            spans[-1] = (seg.run, spans[-1][1], end)
        else:
            spans.append((seg.run, seg.start, end))
    if not spans:
        return []
    assert spans[0][1] == 0 and spans[-1][2] == length, f"segments do not cover [0, {length})"
    return [run.slice(a, b) for run, a, b in spans]


def join_kv(pieces: KVPieces) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """One key and one value tensor per layer: the piece itself, or a concatenation of several."""
    assert pieces, "nothing to join"
    if len(pieces) == 1:
        return pieces[0]
    keys: list[torch.Tensor | None] = []
    values: list[torch.Tensor | None] = []
    for i in range(len(pieces[0][0])):
        ks = [p[0][i] for p in pieces]
        vs = [p[1][i] for p in pieces]
        keys.append(torch.cat(ks, dim=-2) if ks[0] is not None else None)  # type: ignore[arg-type]
        values.append(torch.cat(vs, dim=-2) if vs[0] is not None else None)  # type: ignore[arg-type]
    return keys, values


def best_snapshot(segments: Sequence[Segment], limit: int) -> tuple[int, Snapshot | None]:
    """The longest restorable length at or below `limit` among consecutive `segments` from position 0,
    and the snapshot that restores it (a snapshot with `reach` restores lengths below its own)."""
    best: Snapshot | None = None
    best_len = 0
    for seg in segments:
        if seg.start >= limit:
            break
        for length, snap in seg.snapshots.items():
            # Above seg.start, so the segment holding it is brought back with the prefix.
            usable = min(length, limit)
            if length - snap.reach <= usable and usable > best_len:
                best, best_len = snap, usable
    return best_len, best


def item_states(
    segments: Sequence[Segment], spans: Sequence[tuple[int, int]], limit: int
) -> tuple[int, list[Snapshot]]:
    """The stored states of the items whose spans end at or below `limit`, in order.

    Returns the limit lowered to the start of the first such item without a stored state, and
    the states before it.
    """
    found: list[Snapshot] = []
    for start, end in spans:
        if end > limit:
            break
        state = next((seg.items[end] for seg in segments if seg.start < end <= seg.end and end in seg.items), None)
        if state is None:
            return start, found
        found.append(state)
    return limit, found


def state_tensors(snapshots: Iterable[Snapshot]) -> Iterator[torch.Tensor]:
    """Every tensor held by `snapshots` (recurrent snapshots or item states)."""
    for snap in snapshots:
        for state in snap.states.values():
            for per_idx in state.tensors.values():
                yield from (t for t in per_idx.values() if t is not None)


def all_finite(tensors: Iterable[torch.Tensor | None]) -> bool:
    """Whether every floating-point tensor of `tensors` holds only finite values (meta tensors hold none).

    The checks run on each tensor's own device and are reduced there, so a device costs one
    synchronisation however many tensors it holds.

    >>> all_finite([torch.ones(2), torch.tensor([0.0, float("nan")])])
    False
    >>> all_finite([torch.ones(2, dtype=torch.float64), torch.ones(3, dtype=torch.bfloat16)])
    True
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t is not None and t.numel() and (t.is_floating_point() or t.is_complex()) and not t.is_meta:
            t = torch.view_as_real(t) if t.is_complex() else t
            groups.setdefault((t.device, t.dtype), []).append(t)
    per_device: dict[torch.device, list[torch.Tensor]] = {}
    for (device, dtype), members in groups.items():
        # One multi-tensor reduction per group: a NaN or inf anywhere makes its tensor's norm NaN or
        # inf. Summed in float32, so half-precision states cannot overflow it; only magnitudes near
        # 1e19 could, and those are not stored either.
        wide = torch.float64 if dtype == torch.float64 else torch.float32  # never narrowed
        per_device.setdefault(device, []).extend(torch._foreach_norm(members, 2, dtype=wide))
    return all(bool(torch.stack(norms).isfinite().all()) for norms in per_device.values())
