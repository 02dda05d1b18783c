"""New entries joining the tree: the run that backs a new leaf, and the snapshots and item states its path takes.

Called by `placement.Placement` (under the store's lock) when `prefixes` inserts a finished
sequence; the budgets are enforced by the caller once everything is attached.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from hf_prefix_cache.model.states import ItemState, Run, Snapshot
from hf_prefix_cache.storage.mover import Mover, snapshot_to_host
from hf_prefix_cache.storage.segments import Segment
from hf_prefix_cache.storage.tiers import DEVICE, DISK
from hf_prefix_cache.store.disk_nodes import DiskNodes
from hf_prefix_cache.tree.radix import Node, RadixTree


def place_run(
    run: Run,
    matched: Sequence[Node[Segment]],
    matched_len: int,
    length: int,
    may_move: bool,
    tail: Run | None = None,
) -> None:
    """Make `run` (positions `[0, length)`) back the new leaf without holding a second copy of the prefix.

    When the matched nodes are on the device and their runs back nothing else, they move
    onto `run` and their old tensors are freed: restores along this path stay one view.
    Otherwise only the new tail `[matched_len, length)` is kept, copied out so the prefix
    copy can be freed (`tail`, a copy of exactly those positions made already, is taken instead).
    """
    counts: Counter[int] = Counter()
    old_runs: dict[int, Run] = {}
    movable = may_move
    for node in matched:
        seg = node.value
        assert seg is not None
        if node.tier != DEVICE or seg.run is None:
            movable = False
            break
        counts[id(seg.run)] += 1
        old_runs[id(seg.run)] = seg.run
    if movable:
        for key, count in counts.items():
            if old_runs[key].num_refs != count:
                movable = False  # another node still reads one of the matched runs
                break
    if movable:
        for node in matched:
            assert node.value is not None
            node.value.run = run
            run.take()
    elif tail is not None and (tail.lo, tail.hi) == (matched_len, length):
        run.adopt(tail)
    else:
        run.compact(matched_len, length)


def attach_states(
    tree: RadixTree[Segment],
    mover: Mover,
    files: DiskNodes | None,
    path: Sequence[Node[Segment]],
    snapshots: Sequence[Snapshot],
    items: Sequence[ItemState],
) -> int:
    """Give each snapshot and media item state to the node of `path` whose range holds its length.

    A node that holds one at that length keeps its own. A node on disk has its file rewritten
    once with all of its new snapshots (an item state alone does not rewrite a file). Budgets
    are enforced by the caller after all are attached: enforcing after each one sent the
    entry to disk after its first snapshot and lost the rest. Returns how many snapshots were added.
    """
    added = 0
    on_disk: dict[int, tuple[Node[Segment], list[Snapshot]]] = {}
    for snap in snapshots:
        node = _holder(path, snap.length)
        if node is None:
            continue
        seg = node.value
        assert seg is not None
        if snap.length in seg.snapshots:
            continue
        if node.tier == DISK:
            on_disk.setdefault(id(node), (node, []))[1].append(snap)
            continue
        seg.snapshots[snap.length] = snap if node.tier == DEVICE else snapshot_to_host(snap, mover)
        added += 1
        tree.refresh_nbytes(node)
    for node, snaps in on_disk.values():
        assert files is not None, "a disk node in a store without a disk tier"
        files.add_to_file(node, snaps)
    for state in items:
        node = _holder(path, state.length)
        if node is None:
            continue
        seg = node.value
        assert seg is not None
        if state.length not in seg.items and node.tier != DISK:
            seg.items[state.length] = state if node.tier == DEVICE else snapshot_to_host(state, mover)
            tree.refresh_nbytes(node)
    return added


def _holder(path: Sequence[Node[Segment]], length: int) -> Node[Segment] | None:
    """The node of `path` whose range `(start, end]` holds `length`."""
    return next((node for node in path if node.start < length <= node.end), None)
