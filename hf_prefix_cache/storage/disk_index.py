"""DiskIndex: the disk tier's files as tree nodes: a namespace's files indexed on first use, and saving to disk.

A new process finds the entries an earlier one left on disk by indexing each namespace's files
once, the first time the namespace is used (`index`); each file becomes a disk node under the
prefix it continues (a file whose prefix is not stored is skipped and counted). `save` moves
every unlocked node in memory to disk, bottom-up, for the next process.

Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

import logging

from hf_prefix_cache.storage.moves import TierMoves
from hf_prefix_cache.storage.segments import Segment
from hf_prefix_cache.storage.tiers import DEVICE, DISK, HOST
from hf_prefix_cache.tree.radix import Node

logger = logging.getLogger("hf_prefix_cache")


class DiskIndex:
    """Which namespaces' files are in the tree of `moves`, and saving its nodes to disk.

    Example:
        >>> index = DiskIndex(placement)  # doctest: +SKIP
        >>> index.index("ns"); index.save()  # doctest: +SKIP
        3
    """

    def __init__(self, moves: TierMoves) -> None:
        self.moves = moves
        self._indexed: set[str] = set()

    def index(self, namespace: str) -> None:
        """Add the disk files of `namespace` to the tree, once per namespace and process."""
        moves, disk, tree = self.moves, self.moves.disk, self.moves.tree
        if disk is None or namespace in self._indexed:
            return
        self._indexed.add(namespace)
        added = 0
        entries, skipped = disk.scan(namespace)
        moves.counters.skipped_files += skipped
        for entry in entries:
            match = tree.match(namespace, entry.symbols)
            if match.matched_len != entry.lo:
                moves.counters.skipped_files += 1
                logger.warning(
                    "skipping prefix-cache file %s: it continues a prefix of %d tokens, %d are stored",
                    entry.path,
                    entry.lo,
                    match.matched_len,
                )
                continue
            stub = disk.stub_for(entry)
            tree.insert(namespace, entry.symbols, lambda a, b, stub=stub: stub, tier=DISK)
            moves.counters.num_snapshots += len(stub.snapshots)
            added += 1
        if added:
            logger.info("indexed %d prefix-cache files for namespace %s", added, namespace)
        moves.enforce()

    def save(self) -> int:
        """Move every unlocked node in memory to disk (bottom-up); returns how many moved."""
        moves, tree = self.moves, self.moves.tree
        if moves.disk is None:
            return 0
        moved = 0
        budget = moves.budgets[DISK]
        for tier in (DEVICE, HOST):
            kept: list[Node[Segment]] = []
            while True:
                node = tree.pop_victim(tier)
                if node is None:
                    break
                if node.nbytes > budget or not moves.move(node, DISK):
                    kept.append(node)  # stays in memory: a failed or too small disk must not lose it
                    continue
                moved += 1
                moves.shrink(DISK, budget)
            for node in kept:
                tree.offer(node)
        return moved
