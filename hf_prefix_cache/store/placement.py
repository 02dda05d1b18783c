"""Placement: the store's policy of which tier each node sits on, and the only caller of the tree's eviction verbs.

Nodes leave a tier least valuable first (the policy's score), only from the tier's frontier (see
`tree/radix.py`), and never while locked:

    device --(over budget)--> host --(over budget)--> disk --(over budget)--> dropped

The tiers are `storage/tiers.py`'s list, each a `Tier` (`storage/tier.py`): this module says what
moves where and when, they do the copies and the files. A tier whose budget is 0 is skipped; a
node that fits no slower tier is dropped with its subtree (descendants cannot be restored without
it). A hit on a node off the device brings it back (`bring_to_device`) when room can be made, else
serves a temporary copy. With a remote tier, a node leaving the last local tier first has the
chunks of its sequence that the server lacks queued for writing (`write_remote`).

Composed of parts with one job each, given only what they need: `disk_nodes.py` (the disk
tier's files as nodes: indexing a namespace, split files, new snapshots) and `adoption.py`
(chunks loaded from the remote tier joining the tree). A new request's sequence joins the tree
through `prefixes.py`, which asks this module to put its states on its nodes' tiers
(`attach_states`), keep tiers monotone and keep budgets.

Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence

from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.model.states import ItemState, Snapshot
from hf_prefix_cache.storage.disk import DiskTier
from hf_prefix_cache.storage.memory import DeviceTier, HostTier
from hf_prefix_cache.storage.remote import RemoteTier
from hf_prefix_cache.storage.segments import Segment
from hf_prefix_cache.storage.tier import Tier
from hf_prefix_cache.storage.tiers import DEVICE, DISK, HOST
from hf_prefix_cache.store.adoption import adopt
from hf_prefix_cache.store.disk_nodes import DiskNodes
from hf_prefix_cache.store.node_place import NodePlace
from hf_prefix_cache.store.placement_counters import PlacementCounters
from hf_prefix_cache.tree.policy import CostAwarePolicy, LRUPolicy
from hf_prefix_cache.tree.radix import Node, RadixTree

logger = logging.getLogger("hf_prefix_cache")


class Placement:
    """Moves nodes of `tree` between `tiers` to keep each within `budgets[tier]` bytes, and places new ones.

    Args:
        tree: the store's tree (values are `Segment`s).
        tiers: the local tiers, fastest first (`storage.tiers.make_tiers`).
        budgets: bytes allowed per tier; 0 switches a tier off.
        policy: decides which node leaves first; told when one does.
        remote: the shared tier below the local ones, or None.

    Example:
        >>> from hf_prefix_cache.storage.codec import Layout
        >>> from hf_prefix_cache.storage.mover import Mover
        >>> from hf_prefix_cache.storage.tiers import TierParts, make_tiers
        >>> tiers = make_tiers(TierParts(Mover(), lambda layer: None, Layout(1, (0,), ())))
        >>> placement = Placement(RadixTree(num_tiers=3), tiers, [1 << 20, 0, 0], LRUPolicy())
        >>> placement.make_room(DEVICE, 1 << 10), placement.save()  # no disk tier: nothing to save
        (True, 0)
    """

    def __init__(
        self,
        tree: RadixTree[Segment],
        tiers: Sequence[Tier],
        budgets: list[int],
        policy: LRUPolicy | CostAwarePolicy,
        remote: RemoteTier | None = None,
    ) -> None:
        assert len(budgets) == len(tiers) == tree.num_tiers, f"budgets {budgets} for {len(tiers)} tiers"
        device, host = tiers[DEVICE], tiers[HOST]
        if not isinstance(device, DeviceTier) or not isinstance(host, HostTier):
            raise TypeError(f"the memory tiers are {device.name} and {host.name}, not a DeviceTier and a HostTier")
        self.tree = tree
        self.tiers = tiers
        self.budgets = budgets
        self.policy = policy
        self.remote = remote
        self.device = device
        self._memory = (device, host)  # the tiers that take a node's new states as they are (`attach_states`)
        self.mover = device.mover
        self.disk = next((tier for tier in tiers if isinstance(tier, DiskTier)), None)
        self.counters = PlacementCounters()
        self.files = DiskNodes(tree, tiers, self.disk, self.counters) if self.disk is not None else None
        self._failures: set[tuple[object, ...]] = set()  # kinds of failed moves already logged as warnings

    # ------------------------------------------------------------ budgets
    def enforce(self) -> None:
        """Bring every tier within its budget (as far as unlocked nodes allow)."""
        nbytes = self.tree.tier_nbytes
        for tier, budget in enumerate(self.budgets):
            if nbytes[tier] > budget:
                self.shrink(tier, budget)

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
            for tier in reversed(range(len(self.tiers))):
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
        for slower in range(tier + 1, len(self.tiers)):
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
        assert seg is not None and node.tier < to, f"{node} from tier {node.tier} to {to}"
        tier = self.tiers[to]
        try:
            new = tier.put(seg, NodePlace(self.tree, self.tiers, node))
        except Exception as exc:  # out of host memory, a full or read-only disk, symbols that cannot persist
            kind = (to, type(exc).__name__, getattr(exc, "errno", None))
            first = kind not in self._failures
            self._failures.add(kind)
            self.counters.failed_moves += 1
            logger.log(
                logging.WARNING if first else logging.DEBUG,
                "could not move %d tokens to the %s tier (%s); they stay where they are",
                node.end - node.start,
                tier.name,
                exc,
            )
            return False
        assert new is not None, f"the {tier.name} tier kept no segment for {node}"
        if to == DISK:
            self.counters.disk_writes += 1
        self._release(node, seg)
        self.counters.num_snapshots += len(new.snapshots)
        self.tree.set_value(node, new)
        self.tree.set_tier(node, to)
        self.counters.offloads += 1
        logger.debug("moved tokens [%d, %d) to the %s tier", node.start, node.end, tier.name)
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
        """`seg` (the value `node` held on its tier) no longer backs it: its tier gives back its run or its file.

        A file still read by the other parts of a split node is cut down to what they cover
        (`DiskNodes.rewrite_rest`; `above`: where they are looked for), so held bytes stay equal
        to counted bytes.
        """
        self.counters.num_snapshots -= len(seg.snapshots)
        self.tiers[node.tier].drop(seg)
        if seg.disk is not None and seg.disk.num_refs and self.files is not None:
            self.files.rewrite_rest(above if above is not None else node.parent, seg)

    def drop_corrupt(self, path: Sequence[Node[Segment]], exc: Exception) -> None:
        """Drop the node of `path` whose file `exc` names (it failed its checks on loading)."""
        bad = next(
            n for n in path if n.value is not None and n.value.disk is not None and str(n.value.disk.path) in str(exc)
        )
        logger.warning("dropping a stored prefix whose file is unusable: %s", exc)
        self.counters.skipped_files += 1
        self.drop(bad)

    def drop_inconsistent(self, node: Node[Segment] | None, exc: Exception) -> None:
        """A restore from `node`'s path failed an exactness guard: drop the node (unless a request holds a lease in
        its subtree) so that no later request restores it again (the hook runs the call cold)."""
        if node is not None and node.lock_ref == 0:
            logger.info("dropping a stored prefix whose restore failed an exactness guard: %s", exc)
            self.drop(node)

    def write_remote(self, node: Node[Segment]) -> None:
        """Queue the whole chunks of `node`'s sequence that the remote tier lacks (`put`; sent by its `flush`)."""
        if self.remote is not None and not node.is_root:
            assert node.value is not None
            self.remote.put(node.value, NodePlace(self.tree, self.tiers, node))

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
            place = NodePlace(self.tree, self.tiers, node)
            device_seg = self.device.put(self.tiers[node.tier].get(seg, place), place)
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

    def settle(self, path: Sequence[Node[Segment]]) -> None:
        """Keep tiers monotone after an insert: a new leaf never sits on a faster tier than its parent.

        Ancestors off the device are brought back when room can be made; otherwise the new leaf
        moves down to the slowest ancestor's tier, so every tier's frontier can always empty it.
        """
        leaf = path[-1]
        above = path[:-1]
        for node in above:
            if node.tier != DEVICE:
                break
        else:
            return  # every ancestor is on the device (or there is none)
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

    def attach_states(
        self, path: Sequence[Node[Segment]], snapshots: Sequence[Snapshot], items: Sequence[ItemState]
    ) -> None:
        """Give each snapshot and media item state to the node of `path` whose range holds its length.

        A node that holds one at that length keeps its own. A node in memory takes them through its
        tier (`add_states`: a host node takes copies in host memory); a node on disk has its file
        rewritten once with all of its new snapshots (an item state alone does not rewrite a file),
        which counts them itself. Budgets are enforced by the caller after all are attached:
        enforcing after each one sent the entry to disk after its first snapshot and lost the rest.
        """
        new: dict[int, tuple[Node[Segment], dict[int, Snapshot], dict[int, ItemState]]] = {}
        for snap in snapshots:
            node = _holder(path, snap.length)
            if node is not None and node.value is not None and snap.length not in node.value.snapshots:
                new.setdefault(id(node), (node, {}, {}))[1].setdefault(snap.length, snap)
        for state in items:
            node = _holder(path, state.length)
            if (
                node is not None
                and node.value is not None
                and state.length not in node.value.items
                and node.tier != DISK
            ):
                new.setdefault(id(node), (node, {}, {}))[2].setdefault(state.length, state)
        for node, snaps, states in new.values():
            if node.value is None or (node.tier == DISK and self.files is None):
                raise InconsistentStateError(f"states were attached to {node}, which holds no run in this store")
            if node.tier == DISK and self.files is not None:
                self.files.add_to_file(node, list(snaps.values()))
                continue
            self._memory[node.tier].add_states(node.value, list(snaps.values()), list(states.values()))
            self.counters.num_snapshots += len(snaps)
            self.tree.refresh_nbytes(node)

    # ------------------------------------------------------------ remote chunks
    def adopt(self, namespace: str, symbols: Sequence[Hashable], hit: Segment) -> bool:
        """Add chunks loaded from the remote tier to the tree (see `adoption.adopt`); whether anything was added."""
        result = adopt(self.tree, self.device, max(self.budgets), namespace, symbols, hit)
        if result is None:
            return False
        leaf = result.path[-1]
        assert leaf.value is not None
        self.counters.num_snapshots += len(leaf.value.snapshots)
        self.tree.lock(leaf)  # the request that asked for it restores it next
        try:
            self.settle(result.path)
            self.enforce()
        finally:
            self.tree.unlock(leaf)
        return True

    # ------------------------------------------------------------ the disk tier's files
    def index_disk(self, namespace: str) -> None:
        """Add the disk files of `namespace` to the tree, once per namespace and process (see `DiskNodes.index`)."""
        if self.files is not None and self.files.index(namespace):
            self.enforce()

    def save(self) -> int:
        """Move every unlocked node in memory to disk (bottom-up); returns how many moved."""
        if self.disk is None:
            return 0
        moved = 0
        budget = self.budgets[DISK]
        for tier in range(DISK):
            kept: list[Node[Segment]] = []
            while True:
                node = self.tree.pop_victim(tier)
                if node is None:
                    break
                if node.nbytes > budget or not self.move(node, DISK):
                    kept.append(node)  # stays in memory: a failed or too small disk must not lose it
                    continue
                moved += 1
                self.shrink(DISK, budget)
            for node in kept:
                self.tree.offer(node)
        return moved

    # ------------------------------------------------------------ the whole store
    def clear(self) -> None:
        """Forget every node: clear the tree, delete their files, zero the snapshot count."""
        removed = self.tree.clear()
        if self.disk is not None:
            self.disk.delete_files([n.value for n in removed if n.value is not None])
        self.counters.num_snapshots = 0

    def reset_counters(self) -> None:
        """Zero the counters `CacheStats` reports as events (`num_snapshots` counts what is held, so it stays)."""
        self.counters.reset()
        if self.remote is not None:
            self.remote.reset_counters()


def _holder(path: Sequence[Node[Segment]], length: int) -> Node[Segment] | None:
    """The node of `path` whose range `(start, end]` holds `length`."""
    return next((node for node in path if node.start < length <= node.end), None)
