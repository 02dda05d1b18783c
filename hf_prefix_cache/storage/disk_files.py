"""DiskFiles: each disk file kept equal to the nodes that read it, through splits, departures and new snapshots.

A file holds one stored segment. When its node splits, the parts share the file
(`DiskRef.num_refs` counts them, top-down along one path). A part that stops reading it (brought
back to memory, or dropped) leaves it to the others, and the file is rewritten to hold only what
they cover (`release`); new snapshots for a node on disk are added by rewriting its file
(`add_to_file`). Writes are atomic, and an old file is deleted only once its replacement is in
place, so a failed write keeps the old file (and its extra bytes) rather than losing the entry.

Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from hf_prefix_cache.model.states import Snapshot
from hf_prefix_cache.storage.disk import DiskTier
from hf_prefix_cache.storage.placement_counters import PlacementCounters
from hf_prefix_cache.storage.segments import Segment
from hf_prefix_cache.tree.radix import Node, RadixTree

logger = logging.getLogger("hf_prefix_cache")


class DiskFiles:
    """The files behind the disk nodes of `tree`, written by `disk`; counts its writes in `counters`.

    Example:
        >>> disk = DiskTier("/tmp/cache", layout)  # doctest: +SKIP
        >>> files = DiskFiles(RadixTree(num_tiers=3), disk, PlacementCounters())  # doctest: +SKIP
        >>> files.add_to_file(node_on_disk, [snapshot])  # doctest: +SKIP
        True
    """

    def __init__(self, tree: RadixTree[Segment], disk: DiskTier, counters: PlacementCounters) -> None:
        self.tree = tree
        self.disk = disk
        self.counters = counters

    def release(self, node: Node[Segment], seg: Segment, above: Node[Segment] | None) -> None:
        """`seg` (the disk value `node` held) no longer backs it: delete its file, or cut it down to its other readers.

        `above` is where the other readers are looked for (an ancestor still in the tree; None:
        `node`'s parent).
        """
        ref = seg.disk
        assert ref is not None, f"{node} holds no file"
        ref.num_refs -= 1
        if ref.num_refs == 0:
            self.disk.delete(ref.path)
        else:
            self._rewrite_rest(above if above is not None else node.parent, seg)

    def _rewrite_rest(self, start: Node[Segment] | None, gone: Segment) -> None:
        """A split disk file lost one part: rewrite the part still used (an ancestor) so the file holds only that."""
        assert gone.disk is not None
        walk = start
        while walk is not None and not walk.is_root:
            seg = walk.value
            if seg is not None and seg.disk is gone.disk:
                try:
                    loaded = self.disk.load(seg)
                    new = self.disk.write(str(walk.namespace), self.tree.symbols_of(walk), loaded)
                except Exception as exc:  # keep the old file; its extra bytes are not worth a crash
                    logger.warning("could not rewrite %s: %s", gone.disk.path, exc)
                    return
                self.counters.num_snapshots += len(new.snapshots) - len(seg.snapshots)
                gone.disk.num_refs -= 1
                if gone.disk.num_refs == 0:
                    self.disk.delete(gone.disk.path)
                self.tree.set_value(walk, new)
                return
            walk = walk.parent

    def add_to_file(self, node: Node[Segment], snapshots: Sequence[Snapshot]) -> bool:
        """Add `snapshots` to the file behind disk node `node` by rewriting it; False when that failed.

        The file's every segment (the parts of a split node share it) moves to the new file, so
        the file stays one unit: a new process rebuilds the same nodes from it. The old file is
        deleted only after the new one is in place (writes are atomic).
        """
        seg = node.value
        assert seg is not None and seg.disk is not None, f"{node} is not on disk"
        ref = seg.disk
        chain = _sharers(node)
        assert len(chain) == ref.num_refs, f"{ref.path} counts {ref.num_refs} refs, {len(chain)} nodes share it"
        whole = Segment(None, ref.lo, ref.hi, seg.nbytes_per_token, disk=ref)
        for part in chain:
            assert part.value is not None
            whole.snapshots.update(part.value.snapshots)
            whole.items.update(part.value.items)
        try:
            loaded = self.disk.load(whole)
            loaded.snapshots.update({s.length: s for s in snapshots})
            written = self.disk.write(str(node.namespace), self.tree.symbols_of(chain[-1]), loaded)
        except Exception as exc:  # a full or read-only disk: the old file stays, without these snapshots
            logger.warning("could not add %d snapshots to %s (%s); keeping it as it was", len(snapshots), ref.path, exc)
            return False
        new_ref = written.disk
        assert new_ref is not None
        new_ref.num_refs = len(chain)
        for part in chain:
            assert part.value is not None
            inside = range(part.start + 1, part.end + 1)
            self.tree.set_value(
                part,
                Segment(
                    None,
                    part.start,
                    part.end,
                    part.value.nbytes_per_token,
                    {n: s for n, s in written.snapshots.items() if n in inside},
                    disk=new_ref,
                    items={n: s for n, s in written.items.items() if n in inside},
                ),
            )
        self.counters.num_snapshots += len(snapshots)
        self.counters.disk_writes += 1
        self.disk.delete(ref.path)
        return True

    def delete_all(self, removed: Sequence[Node[Segment]]) -> None:
        """Delete the files behind `removed` (nodes the tree no longer holds), each once."""
        refs = {id(n.value.disk): n.value.disk for n in removed if n.value is not None and n.value.disk}
        for ref in refs.values():
            if ref is not None:
                self.disk.delete(ref.path)


def _sharers(node: Node[Segment]) -> list[Node[Segment]]:
    """The nodes reading `node`'s file, top-down: the parts of one split node, a chain along a path."""
    assert node.value is not None
    ref = node.value.disk
    top = node
    while top.parent is not None and top.parent.value is not None and top.parent.value.disk is ref:
        top = top.parent
    chain = [top]
    while True:
        below = next((c for c in chain[-1].children.values() if c.value is not None and c.value.disk is ref), None)
        if below is None:
            return chain
        chain.append(below)
