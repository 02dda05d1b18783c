"""What a tree node holds: a range of keys/values in a shared run, plus state snapshots.

A `Run` owns the key/value tensors of consecutive positions `[lo, hi)` of one sequence, for
every layer that has keys. Nodes refer to sub-ranges of a run by absolute position, so a
prefix that lies in one run restores as a view with no copy, and a node split is free.

Invariant (`check_runs`, run by `store/integrity.py`): the segments that refer to a run cover
`[lo, hi)` exactly, so the bytes of all segments add up to the bytes actually held. A segment
dropped gives its range back (`Run.give_back`, which compacts a run still read by others); a new
one shares its run with the stored prefix or keeps its own range alone (`share_run`).

A segment may also hold *item states*: tensors computed from one media item alone (Mllama:
an image's cross-attention keys/values), kept under the position after the item's
placeholder, so a prefix that contains the placeholder restores them with it.

A run lives on the model's devices (each layer's tensors on that layer's device) or in host
memory; a segment on disk has no run but a `DiskRef` to the file holding its range. Runs off
the device back exactly one tree node each until that node is split; `tiers.py` moves them.

Reading a path back: `kv_pieces` (views into its runs), `landings` (copies into them still on
their way), `join_kv`, and `restore_pieces`, which restores them into a request's working cache.

Knows nothing about the tree or about models (only the runs, states and working cache of `model/`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.model.landing import Landing, land_all
from hf_prefix_cache.model.runs import Run
from hf_prefix_cache.model.states import ItemState, Snapshot
from hf_prefix_cache.storage.host_pool import size_class

if TYPE_CHECKING:
    from hf_prefix_cache.model.working_cache import WorkingCache

logger = logging.getLogger("hf_prefix_cache")


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
    items: dict[int, ItemState] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        nbytes = (self.end - self.start) * self.nbytes_per_token
        if self.snapshots:
            for snap in self.snapshots.values():
                nbytes += snap.nbytes
        if self.items:
            for item in self.items.values():
                nbytes += item.nbytes
        return nbytes

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
            self.run.take()  # one segment became two
        if self.disk is not None:
            self.disk.num_refs += 1
        return head, tail


def share_run(leaf: Segment, before: Sequence[Segment] | None, tail: Run | None = None) -> None:
    """Make `leaf`'s run (positions `[0, leaf.end)`) back it without holding a second copy of the prefix.

    `before` are the segments of the stored prefix `[0, leaf.start)` where they may move (all on
    the device, and the insert is of one whole sequence), else None. They move onto the run when
    their runs back nothing else (a chat continuing): restores along the path stay one view and
    the old tensors are freed. Otherwise the run keeps only the leaf's own positions, copied out so
    the prefix copy can be freed (`tail`: a copy of exactly those positions, made already).

    >>> run = Run([torch.arange(8.0).view(1, 1, 4, 2)], [torch.zeros(1, 1, 4, 2)], 0, 4)
    >>> leaf = Segment(run, 3, 4, run.nbytes_per_token)
    >>> share_run(leaf, None)  # no prefix may move: the run keeps position 3 alone
    >>> (run.lo, run.hi, run.num_refs)
    (3, 4, 1)
    """
    run = leaf.run
    if run is None:
        return
    run.take()
    if before is not None and _runs_back_only(before):
        for seg in before:
            seg.run = run
            run.take()
    else:
        run.compact(leaf.start, leaf.end, copy=tail)


def _runs_back_only(segments: Sequence[Segment]) -> bool:
    """Whether every segment has a run and those runs are read by these segments and no other."""
    counts: dict[int, int] = {}
    for seg in segments:
        if seg.run is None:
            return False
        counts[id(seg.run)] = counts.get(id(seg.run), 0) + 1
    for seg in segments:  # noqa: SIM110 - runs on every insert: a loop, not a generator's call per segment
        if seg.run is not None and seg.run.num_refs != counts[id(seg.run)]:
            return False  # another segment still reads this run
    return True


def tail_from(seg: Segment, at: int) -> Segment:
    """The part of `seg` (read by no other segment) from position `at` on, its run cut down to that part.

    >>> run = Run([torch.ones(1, 1, 4, 2)], [torch.zeros(1, 1, 4, 2)], 0, 4)
    >>> part = tail_from(Segment(run, 0, 4, run.nbytes_per_token), 1)
    >>> (part.start, part.end, run.lo, run.hi)
    (1, 4, 1, 4)
    """
    if seg.run is not None:
        seg.run.compact(at, seg.end)
    snapshots = {n: s for n, s in seg.snapshots.items() if n > at}
    items = {n: s for n, s in seg.items.items() if n > at}
    return Segment(seg.run, at, seg.end, seg.nbytes_per_token, snapshots, items=items)


KVPieces = list[tuple[list[torch.Tensor | None], list[torch.Tensor | None]]]


def kv_pieces(segments: Sequence[Segment], length: int, land: bool = True) -> KVPieces:
    """Views of positions `[0, length)` from consecutive segments starting at 0, one per run.

    Segments that continue each other in one run merge into one view, so a prefix that lies in
    one run (the usual case) is a single piece. Empty for `length == 0` or segments without keys.
    With `land=False` copies still landing in a run are not waited for (see `landings`).
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
    if spans[0][1] != 0 or spans[-1][2] != length:
        raise InconsistentStateError(f"segments do not cover [0, {length})")
    if len(spans) == 1:
        run, a, b = spans[0]
        return [run.slice(a, b, land)]
    pieces: KVPieces = []
    for run, a, b in spans:
        pieces.append(run.slice(a, b, land))
    return pieces


def landings(segments: Sequence[Segment], length: int) -> list[Landing]:
    """The landings of the runs that `kv_pieces(segments, length)` reads: what a reader must wait for per layer."""
    out: list[Landing] = []
    for seg in segments:
        if seg.start >= length or seg.run is None:
            break
        landing = seg.run.landing
        if landing is not None and all(landing is not seen for seen in out):
            out.append(landing)
    return out


def join_kv(pieces: KVPieces) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """One key and one value tensor per layer: the piece itself, or a concatenation of several."""
    assert pieces, "nothing to join"
    if len(pieces) == 1:
        return pieces[0]
    keys: list[torch.Tensor | None] = []
    values: list[torch.Tensor | None] = []
    for i in range(len(pieces[0][0])):
        if pieces[0][0][i] is None:
            keys.append(None)
            values.append(None)
            continue
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        for piece_keys, piece_values in pieces:
            ks.append(piece_keys[i])  # type: ignore[arg-type]
            vs.append(piece_values[i])  # type: ignore[arg-type]
        keys.append(torch.cat(ks, dim=-2))
        values.append(torch.cat(vs, dim=-2))
    return keys, values


def restore_pieces(
    into: WorkingCache,
    length: int,
    pieces: KVPieces,
    pending: list[Landing],
    snapshot: Snapshot | None,
    items: list[ItemState],
    batch_size: int,
    overlap: bool,
) -> None:
    """Restore `length` positions into `into`: the `pieces` that `kv_pieces` read (a join copies only across
    runs), the copies into them still landing (`landings`), and `snapshot` and `items`.

    With `overlap`, where the model allows (`WorkingCache.restore(landing=...)`), pieces still
    landing from host memory, or lying in several runs, restore layer by layer at first use:
    copies overlap the prefill, and the layer's own concatenation joins the pieces (a join
    here would copy the whole prefix once more). Elsewhere every copy lands first. The views
    stay valid: a compaction swaps a run's tensors for new ones and never writes into the old ones.
    """
    if overlap and pieces and (pending or len(pieces) > 1) and into.defers_keys:
        logger.debug("restoring %d tokens from %d pieces layer by layer at first use", length, len(pieces))
        into.restore(length, None, None, None, batch_size=batch_size, landing=(pieces, pending))
        return
    if pending:
        logger.debug(
            "restoring %d tokens after every copy from host memory has landed (%s)",
            length,
            "not a model whose layers can be set at first use" if overlap else "a lookup",
        )
        land_all(pending)
    keys, values = join_kv(pieces) if into.profile.has_kv else (None, None)
    into.restore(length, keys, values, snapshot, batch_size=batch_size, items=items)


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


def stored_item_states(
    segments: Sequence[Segment], spans: Sequence[tuple[int, int]], limit: int
) -> tuple[int, list[ItemState]]:
    """The stored states of the items whose spans end at or below `limit`, in order.

    Returns the limit lowered to the start of the first such item without a stored state, and
    the states before it.
    """
    found: list[ItemState] = []
    for start, end in spans:
        if end > limit:
            break
        state = next((seg.items[end] for seg in segments if seg.start < end <= seg.end and end in seg.items), None)
        if state is None:
            return start, found
        found.append(state)
    return limit, found


def in_host_memory(seg: Segment) -> bool:
    """Whether every key tensor of `seg`'s run lies in CPU memory (what a segment on the host tier holds)."""
    return seg.run is None or all(t is None or t.device.type == "cpu" for t in seg.run.keys)


def check_runs(segments: Iterable[Segment], pooled: Callable[[torch.Tensor], bool] | None = None) -> None:
    """Raise `RuntimeError` where the runs that `segments` read break the module's invariant.

    The segments reading a run must cover its range exactly, as many as it counts references,
    and its tensors' storages must hold no bytes beyond theirs (a buffer of the host tier's pool,
    where `pooled` says a tensor views one, holds its size class: `host_pool.size_class`).
    """
    covered: dict[int, tuple[Run, list[tuple[int, int]]]] = {}
    for seg in segments:
        if seg.run is not None:
            covered.setdefault(id(seg.run), (seg.run, []))[1].append((seg.start, seg.end))
    for run, spans in covered.values():
        # The storages a run's tensors view (one each, or one batched host copy for all) hold just their bytes.
        storages: dict[tuple[str, int], list[torch.Tensor]] = {}
        for t in [*run.keys, *run.values]:
            if t is not None:
                storages.setdefault(_storage_key(t), []).append(t)
        for members in storages.values():
            held, needed = members[0].untyped_storage().nbytes(), sum(t.nbytes for t in members)
            allowed = size_class(needed) if pooled is not None and pooled(members[0]) else needed
            if held != allowed:
                raise RuntimeError(f"run [{run.lo}, {run.hi}) keeps {held} bytes for tensors of {needed}")
        spans.sort()
        if run.num_refs != len(spans):
            raise RuntimeError(f"run [{run.lo}, {run.hi}) counts {run.num_refs} refs, tree has {len(spans)}")
        if (
            spans[0][0] != run.lo
            or spans[-1][1] != run.hi
            or any(spans[i][1] != spans[i + 1][0] for i in range(len(spans) - 1))
        ):
            raise RuntimeError(f"run [{run.lo}, {run.hi}) is covered by {spans}")


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    """What tells tensors' storages apart: their address; meta tensors have none (every one reads 0), so they are
    keyed by the tensor they view (views of one packed copy share its storage, others have their own)."""
    ptr = tensor.untyped_storage().data_ptr()
    if ptr:
        return (tensor.device.type, ptr)
    return ("no address", id(tensor._base if tensor._base is not None else tensor))
