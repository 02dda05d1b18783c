"""TierMoves: keeping every tier within its byte budget by moving nodes down, up, or out of the store.

Nodes leave a tier least valuable first (the policy's score), only from the tier's frontier (see
`radix.py`), and never while locked:

    device --(over budget)--> host --(over budget)--> disk --(over budget)--> dropped

A tier whose budget is 0 is skipped; a node that fits no slower tier is dropped with its
subtree (descendants cannot be restored without it). A hit on a node off the device brings it
back (`bring_to_device`) when room can be made, else serves a temporary copy. `tiers.py` does
the copies, `disk.py` the files and `disk_files.py` keeps shared files right; with a remote tier
(`remote.py`), a node leaving the last local tier first has the chunks of its sequence that the
server lacks queued for writing (`write_remote`).

Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from hf_prefix_cache.storage.disk import DiskTier
from hf_prefix_cache.storage.disk_files import DiskFiles
from hf_prefix_cache.storage.placement_counters import PlacementCounters
from hf_prefix_cache.storage.remote_chunks import queue_missing_chunks
from hf_prefix_cache.storage.segments import Segment
from hf_prefix_cache.storage.tiers import DEVICE, HOST, NUM_TIERS, Mover, segment_to_device, segment_to_host
from hf_prefix_cache.tree.policy import CostAwarePolicy, LRUPolicy
from hf_prefix_cache.tree.radix import Node, RadixTree

if TYPE_CHECKING:
    from hf_prefix_cache.storage.remote import RemoteTier

logger = logging.getLogger("hf_prefix_cache")

_TIER_NAMES = ("device", "host", "disk")


class TierMoves:
    """Moves nodes of `tree` between tiers to keep each within `budgets[tier]` bytes.

    Args:
        tree: the store's tree (values are `Segment`s).
        budgets: bytes allowed per tier (device, host, disk); 0 switches a tier off.
        mover: copies tensors between devices and host memory.
        disk: the disk tier, or None.
        policy: decides which node leaves first; told when one does.
        state_device: the device a stateful layer's snapshot goes back to.
        remote: the shared tier below the local ones, or None.

    Example:
        >>> moves = TierMoves(RadixTree(num_tiers=3), [1 << 20, 0, 0], Mover(), None, LRUPolicy(), lambda i: None)
        >>> moves.make_room(DEVICE, 1 << 10)
        True
    """

    def __init__(
        self,
        tree: RadixTree[Segment],
        budgets: list[int],
        mover: Mover,
        disk: DiskTier | None,
        policy: LRUPolicy | CostAwarePolicy,
        state_device: Callable[[int], torch.device | None],
        remote: RemoteTier | None = None,
    ) -> None:
        assert len(budgets) == NUM_TIERS, f"budgets for {NUM_TIERS} tiers, got {budgets}"
        self.tree = tree
        self.budgets = budgets
        self.mover = mover
        self.disk = disk
        self.policy = policy
        self.state_device = state_device
        self.remote = remote
        self.counters = PlacementCounters()
        self.files = DiskFiles(tree, disk, self.counters) if disk is not None else None
        self._failures: set[tuple[object, ...]] = set()  # kinds of failed moves already logged as warnings

    # ------------------------------------------------------------ budgets
    def enforce(self) -> None:
        """Bring every tier within its budget (as far as unlocked nodes allow)."""
        for tier in range(NUM_TIERS):
            self.shrink(tier, self.budgets[tier])

    def make_room(self, tier: int, nbytes: int) -> bool:
        """Move nodes out of `tier` until `nbytes` more fit in its budget; False when they cannot."""
        if nbytes > self.budgets[tier]:
            return False
        self.shrink(tier, self.budgets[tier] - nbytes)
        self.enforce()
        return self.tree.tier_nbytes[tier] + nbytes <= self.budgets[tier]

    def free_device(self) -> None:
        """Move every unlocked node off the device (after an out-of-memory error)."""
        self.shrink(DEVICE, 0)
        self.enforce()

    def drop_leaves(self, num_leaves: int) -> None:
        """Drop `num_leaves` least valuable unlocked leaves, slowest tier first."""
        for _ in range(num_leaves):
            node = None
            for tier in reversed(range(NUM_TIERS)):
                node = self.tree.pop_victim(tier, leaves_only=True)
                if node is not None:
                    break
            if node is None:
                return
            self.write_remote(node)  # a capacity drop, like a budget one: the entry leaves the last local tier
            self.drop(node)

    def shrink(self, tier: int, target: int) -> None:
        """Move the least valuable frontier nodes of `tier` down until it holds at most `target` bytes."""
        stuck: list[Node[Segment]] = []
        while self.tree.tier_nbytes[tier] > target:
            node = self.tree.pop_victim(tier)
            if node is None:
                break  # everything left is locked (or could not move)
            self.policy.left(node)
            if not self._move_down(node, tier):
                stuck.append(node)
        for node in stuck:
            self.tree.offer(node)  # tried again at the next enforce

    def _move_down(self, node: Node[Segment], tier: int) -> bool:
        """Move `node` to the next tier that can hold it, or drop it with its subtree when none can.

        Returns False when a slower tier could hold it but every write failed (a full or
        read-only disk, host memory exhausted): the node then stays where it is, over budget,
        rather than being lost because a lower tier failed.
        """
        failed = False
        for slower in range(tier + 1, NUM_TIERS):
            fits = 0 < node.nbytes <= self.budgets[slower] or (node.nbytes == 0 and self.budgets[slower] > 0)
            if fits:
                if self.move(node, slower):
                    self.tree.offer(node)
                    return True
                failed = True
        if failed:
            return False
        self.write_remote(node)
        self.drop(node)
        return True

    def move(self, node: Node[Segment], to: int) -> bool:
        """Copy `node`'s value to the slower tier `to` and release the old one; False (logged) when that failed."""
        seg = node.value
        assert seg is not None
        try:
            if to == HOST:
                new = segment_to_host(seg, self.mover)
            else:
                assert self.disk is not None
                source = seg if seg.disk is None else None
                assert source is not None, f"{node} is already on disk"
                new = self.disk.write(str(node.namespace), self.tree.symbols_of(node), source)
                self.counters.disk_writes += 1
        except Exception as exc:  # out of host memory, a full or read-only disk, symbols that cannot persist
            kind = (to, type(exc).__name__, getattr(exc, "errno", None))
            first = kind not in self._failures
            self._failures.add(kind)
            self.counters.failed_moves += 1
            logger.log(
                logging.WARNING if first else logging.DEBUG,
                "could not move %d tokens to the %s tier (%s); they stay where they are",
                node.end - node.start,
                _TIER_NAMES[to],
                exc,
            )
            return False
        self._release(node, seg)
        self.counters.num_snapshots += len(new.snapshots)
        self.tree.set_value(node, new)
        self.tree.set_tier(node, to)
        self.counters.offloads += 1
        logger.debug("moved tokens [%d, %d) to the %s tier", node.start, node.end, _TIER_NAMES[to])
        return True

    # ------------------------------------------------------------ dropping
    def drop(self, node: Node[Segment]) -> None:
        """Remove `node` and its subtree from the store, releasing what they hold."""
        above = node.parent
        if node.children:
            removed = self.tree.remove(node)
        else:
            self.tree.remove_leaf(node)
            removed = [node]
        self.counters.evictions += len(removed)
        self.counters.evicted_bytes += sum(n.nbytes for n in removed)
        logger.debug("dropped %d nodes (%d bytes)", len(removed), sum(n.nbytes for n in removed))
        for gone in removed:
            assert gone.value is not None
            self._release(gone, gone.value, above)

    def _release(self, node: Node[Segment], seg: Segment, above: Node[Segment] | None = None) -> None:
        """`seg` (the value `node` held) no longer backs it: give back its run and its file.

        A run or file still read by other segments is cut down to what they cover, so held bytes
        stay equal to counted bytes.
        """
        self.counters.num_snapshots -= len(seg.snapshots)
        if seg.run is not None:
            seg.run.give_back(seg.start, seg.end)
        if seg.disk is not None and self.files is not None:
            self.files.release(node, seg, above)

    def write_remote(self, node: Node[Segment]) -> None:
        """Queue the whole chunks of `node`'s sequence that the remote tier lacks (sent by `RemoteTier.flush`)."""
        if self.remote is not None:
            queue_missing_chunks(self.tree, self.remote, self.disk, node)

    # ------------------------------------------------------------ bringing back
    def bring_to_device(self, path: Sequence[Node[Segment]], length: int) -> list[Segment]:
        """Segments of `path` covering `[0, length)`, all in device memory, in path order.

        Nodes off the device come back to it when room can be made; otherwise a temporary
        device copy serves this request and the node stays where it is. The path must be locked.

        Raises:
            CorruptFileError: a disk file on the path could not be used (the caller drops it).
            torch.OutOfMemoryError: a copy to the device did not fit.
        """
        out: list[Segment] = []
        promote = True  # once an ancestor stays off the device, its descendants do too (tiers stay monotone)
        for node in path:
            seg = node.value
            assert seg is not None
            if node.start >= length or node.tier == DEVICE:
                out.append(seg)
                continue
            host = seg
            if seg.disk is not None:
                assert self.disk is not None, "a disk segment in a store without a disk tier"
                host = self.disk.load(seg)
            device_seg = segment_to_device(host, self.mover, self.state_devices(host))
            self.counters.reloads += 1
            logger.debug("brought tokens [%d, %d) back to the device", node.start, node.end)
            promote = promote and self.make_room(DEVICE, node.nbytes)
            if promote:
                self._release(node, seg)
                self.counters.num_snapshots += len(device_seg.snapshots)
                self.tree.set_value(node, device_seg)
                self.tree.set_tier(node, DEVICE)
            out.append(device_seg)  # else a copy for this request only; the node stays where it is
        return out

    def state_devices(self, seg: Segment) -> dict[int, torch.device | None]:
        """The device of each layer whose states `seg`'s snapshots and item states hold."""
        held = [*seg.snapshots.values(), *seg.items.values()]
        return {layer: self.state_device(layer) for snap in held for layer in snap.states}

    def settle(self, path: Sequence[Node[Segment]]) -> None:
        """Keep tiers monotone after an insert: a new leaf never sits on a faster tier than its parent.

        Ancestors off the device are brought back when room can be made; otherwise the new leaf
        moves down to the slowest ancestor's tier, so every tier's frontier can always empty it.
        """
        leaf = path[-1]
        above = path[:-1]
        if not above or max(node.tier for node in above) == DEVICE:
            return
        self.tree.lock(leaf)
        try:
            self.bring_to_device(above, leaf.start)
        finally:
            self.tree.unlock(leaf)
        slowest = max(node.tier for node in above)
        if slowest != DEVICE and leaf.parent is not None and leaf.tier < slowest:
            if leaf.nbytes > self.budgets[slowest] or not self.move(leaf, slowest):
                self.drop(leaf)
            else:
                self.tree.offer(leaf)
