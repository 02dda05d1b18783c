"""New entries joining the tree: the snapshots and media item states a new path takes.

Called by `placement.Placement` (under the store's lock) when `prefixes` inserts a finished
sequence; the budgets are enforced by the caller once everything is attached.
"""

from __future__ import annotations

from collections.abc import Sequence

from hf_prefix_cache.model.states import ItemState, Snapshot
from hf_prefix_cache.storage.mover import Mover, snapshot_to_host
from hf_prefix_cache.storage.segments import Segment
from hf_prefix_cache.storage.tiers import DEVICE, DISK
from hf_prefix_cache.store.disk_nodes import DiskNodes
from hf_prefix_cache.tree.radix import Node, RadixTree


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
