"""DiskNodes: the disk tier's files as tree nodes, indexed on first use and kept equal to the nodes that read them.

A new process finds the entries an earlier one left on disk by indexing each namespace's files
once, the first time the namespace is used (`index`); each file becomes a disk node under the
prefix it continues (a file whose prefix is not stored is skipped and counted).

A file holds one stored segment. When its node splits, the parts share the file
(`DiskRef.num_refs` counts them, top-down along one path). A part that stops reading it (brought
back to memory, or dropped) leaves it to the others, and the file is rewritten to hold only what
they cover (`rewrite_rest`); new snapshots for a node on disk are added by rewriting its file
(`add_to_file`). The disk tier (`storage/disk.py`) reads and writes the files; this module finds
the nodes. Writes are atomic, and an old file is deleted only once its replacement is in place,
so a failed write keeps the old file (and its extra bytes) rather than losing the entry.

Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from hf_prefix_cache.model.states import Snapshot
from hf_prefix_cache.storage.disk import DiskTier
from hf_prefix_cache.storage.segments import Segment
from hf_prefix_cache.storage.tier import Tier
from hf_prefix_cache.storage.tiers import DISK
from hf_prefix_cache.store.node_place import NodePlace
from hf_prefix_cache.store.placement_counters import PlacementCounters
from hf_prefix_cache.tree.radix import Node, RadixTree

logger = logging.getLogger("hf_prefix_cache")


class DiskNodes:
    """The disk nodes of `tree` (whose nodes sit on `tiers`), their files written by `disk`; counts in `counters`.

    Example:
        >>> files = DiskNodes(tree, tiers, disk, PlacementCounters())  # doctest: +SKIP
        >>> files.index("ns"), files.add_to_file(node_on_disk, [snapshot])  # doctest: +SKIP
        (True, True)
    """

    def __init__(
        self, tree: RadixTree[Segment], tiers: Sequence[Tier], disk: DiskTier, counters: PlacementCounters
    ) -> None:
        self.tree = tree
        self.tiers = tiers
        self.disk = disk
        self.counters = counters
        self._indexed: set[str] = set()

    def index(self, namespace: str) -> bool:
        """Add the disk files of `namespace` to the tree, once per namespace and process; whether it did now."""
        if namespace in self._indexed:
            return False
        self._indexed.add(namespace)
        added = 0
        entries, skipped = self.disk.scan(namespace)
        self.counters.skipped_files += skipped
        for entry in entries:
            match = self.tree.match(namespace, entry.symbols)
            if match.matched_len != entry.lo:
                self.counters.skipped_files += 1
                logger.warning(
                    "skipping prefix-cache file %s: it continues a prefix of %d tokens, %d are stored",
                    entry.path,
                    entry.lo,
                    match.matched_len,
                )
                continue
            stub = self.disk.stub_for(entry)
            self.tree.insert(namespace, entry.symbols, lambda a, b, stub=stub: stub, tier=DISK)
            self.counters.num_snapshots += len(stub.snapshots)
            added += 1
        if added:
            logger.info("indexed %d prefix-cache files for namespace %s", added, namespace)
        return True

    def rewrite_rest(self, start: Node[Segment] | None, gone: Segment) -> None:
        """A split file lost part `gone`: rewrite the part still used (an ancestor from `start` up) to hold it alone."""
        assert gone.disk is not None
        walk = start
        while walk is not None and not walk.is_root:
            seg = walk.value
            if seg is not None and seg.disk is gone.disk:
                try:
                    place = self._place(walk)
                    new = self.disk.put(self.disk.get(seg, place), place)
                except Exception as exc:  # keep the old file; its extra bytes are not worth a crash
                    logger.warning("could not rewrite %s: %s", gone.disk.path, exc)
                    return
                self.counters.num_snapshots += len(new.snapshots) - len(seg.snapshots)
                self.disk.drop(seg)
                self.tree.set_value(walk, new)
                return
            walk = walk.parent

    def add_to_file(self, node: Node[Segment], snapshots: Sequence[Snapshot]) -> bool:
        """Add `snapshots` to the file behind disk node `node` by rewriting it; False when that failed.

        The file's every segment (the parts of a split node share it) moves to the new file, so
        the file stays one unit: a new process rebuilds the same nodes from it.
        """
        chain = _sharers(node)
        parts = [_value(part) for part in chain]
        ref = parts[0].disk
        assert ref is not None and len(chain) == ref.num_refs, f"{ref} is shared by {len(chain)} nodes"
        try:
            written = self.disk.add_snapshots(parts, snapshots, self._place(chain[-1]))
        except Exception as exc:  # a full or read-only disk: the old file stays, without these snapshots
            logger.warning("could not add %d snapshots to %s (%s); keeping it as it was", len(snapshots), ref.path, exc)
            return False
        for part, new in zip(chain, written, strict=True):
            self.tree.set_value(part, new)
        self.counters.num_snapshots += len(snapshots)
        self.counters.disk_writes += 1
        return True

    def _place(self, node: Node[Segment]) -> NodePlace:
        return NodePlace(self.tree, self.tiers, node)


def _value(node: Node[Segment]) -> Segment:
    assert node.value is not None, f"{node} holds no segment"
    return node.value


def _sharers(node: Node[Segment]) -> list[Node[Segment]]:
    """The nodes reading `node`'s file, top-down: the parts of one split node, a chain along a path."""
    ref = _value(node).disk
    assert ref is not None, f"{node} is not on disk"
    top = node
    while top.parent is not None and top.parent.value is not None and top.parent.value.disk is ref:
        top = top.parent
    chain = [top]
    while True:
        below = next((c for c in chain[-1].children.values() if c.value is not None and c.value.disk is ref), None)
        if below is None:
            return chain
        chain.append(below)
