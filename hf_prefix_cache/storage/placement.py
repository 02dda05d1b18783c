"""Placement: which tier each stored node sits on, and keeping every tier within its byte budget.

The store's one handle on where its nodes live, made of parts with one job each:

- `moves.py` (`TierMoves`, which `Placement` extends): budgets, and moving nodes down, up
  and out of the store;
- `disk_files.py`: the disk files behind split nodes, and adding snapshots to a file;
- `disk_index.py`: a namespace's files indexed into the tree on first use, and `save`;
- `adoption.py`: chunks loaded from the remote tier joining the tree.

`Placement` itself places new entries: the run backing a new leaf (`place_run`) and the
snapshots and media item states that come with it (`attach_states`).

Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Hashable, Sequence
from functools import cached_property

from hf_prefix_cache.model.states import ItemState, Run, Snapshot
from hf_prefix_cache.storage.adoption import adopt
from hf_prefix_cache.storage.disk_index import DiskIndex
from hf_prefix_cache.storage.moves import TierMoves
from hf_prefix_cache.storage.segments import Segment
from hf_prefix_cache.storage.tiers import DEVICE, DISK, snapshot_to_host
from hf_prefix_cache.tree.radix import Node

logger = logging.getLogger("hf_prefix_cache")


class Placement(TierMoves):
    """Moves nodes of `tree` between tiers to keep each within `budgets[tier]` bytes, and places new ones.

    Made with the arguments of `TierMoves`.

    Example:
        >>> from hf_prefix_cache.storage.tiers import Mover
        >>> from hf_prefix_cache.tree.policy import LRUPolicy
        >>> from hf_prefix_cache.tree.radix import RadixTree
        >>> placement = Placement(RadixTree(num_tiers=3), [1 << 20, 0, 0], Mover(), None, LRUPolicy(), lambda i: None)
        >>> placement.save()  # no disk tier: nothing to save
        0
    """

    @cached_property
    def _index(self) -> DiskIndex:
        return DiskIndex(self)

    # ------------------------------------------------------------ new entries
    def place_run(
        self,
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
        if movable and all(old_runs[key].num_refs == count for key, count in counts.items()):
            for node in matched:
                assert node.value is not None
                node.value.run = run
                run.take()
        elif tail is not None and (tail.lo, tail.hi) == (matched_len, length):
            run.adopt(tail)
        else:
            run.compact(matched_len, length)

    def attach_states(
        self, path: Sequence[Node[Segment]], snapshots: Sequence[Snapshot], items: Sequence[ItemState]
    ) -> None:
        """Give each snapshot and media item state to the node of `path` whose range holds its length.

        A node that holds one at that length keeps its own. A node on disk has its file rewritten
        once with all of its new snapshots (an item state alone does not rewrite a file). Budgets
        are enforced by the caller after all are attached: enforcing after each one sent the
        entry to disk after its first snapshot and lost the rest.
        """
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
            seg.snapshots[snap.length] = snap if node.tier == DEVICE else snapshot_to_host(snap, self.mover)
            self.counters.num_snapshots += 1
            self.tree.refresh_nbytes(node)
        for node, snaps in on_disk.values():
            assert self.files is not None, "a disk node in a store without a disk tier"
            self.files.add_to_file(node, snaps)
        for state in items:
            node = _holder(path, state.length)
            if node is None:
                continue
            seg = node.value
            assert seg is not None
            if state.length not in seg.items and node.tier != DISK:
                seg.items[state.length] = state if node.tier == DEVICE else snapshot_to_host(state, self.mover)
                self.tree.refresh_nbytes(node)

    def adopt(self, namespace: str, symbols: Sequence[Hashable], hit: Segment) -> bool:
        """Add chunks loaded from the remote tier to the tree (see `adoption.adopt`); whether anything was added."""
        return adopt(self, namespace, symbols, hit)

    # ------------------------------------------------------------ the disk tier's files
    def index_disk(self, namespace: str) -> None:
        """Add the disk files of `namespace` to the tree, once per namespace and process (see `DiskIndex`)."""
        self._index.index(namespace)

    def save(self) -> int:
        """Move every unlocked node in memory to disk (bottom-up); returns how many moved."""
        return self._index.save()

    def drop_corrupt(self, path: Sequence[Node[Segment]], exc: Exception) -> None:
        """Drop the node of `path` whose file `exc` names (it failed its checks on loading)."""
        bad = next(
            n for n in path if n.value is not None and n.value.disk is not None and str(n.value.disk.path) in str(exc)
        )
        logger.warning("dropping a stored prefix whose file is unusable: %s", exc)
        self.counters.skipped_files += 1
        self.drop(bad)

    # ------------------------------------------------------------ the whole store
    def clear(self) -> None:
        """Forget every node (the caller clears the tree): delete their files, zero the snapshot count."""
        removed = self.tree.clear()
        if self.files is not None:
            self.files.delete_all(removed)
        self.counters.num_snapshots = 0

    def reset_counters(self) -> None:
        """Zero the counters `CacheStats` reports as events (`num_snapshots` counts what is held, so it stays)."""
        self.counters.reset()
        if self.remote is not None:
            self.remote.reset_counters()


def _holder(path: Sequence[Node[Segment]], length: int) -> Node[Segment] | None:
    """The node of `path` whose range `(start, end]` holds `length`."""
    return next((node for node in path if node.start < length <= node.end), None)
