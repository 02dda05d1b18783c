"""Placement: which tier each stored node sits on, and keeping every tier within its byte budget.

Owns the decisions (when a node leaves the device, when it comes back, when it is dropped);
`tiers.py` does the copies and `disk.py` the files. Nodes leave a tier least valuable first
(the policy's score), only from the tier's frontier (see `radix.py`), and never while locked:

    device --(over budget)--> host --(over budget)--> disk --(over budget)--> dropped

A tier whose budget is 0 is skipped; a node that fits no slower tier is dropped with its
subtree (descendants cannot be restored without it). A hit on a node off the device brings it
back (`bring_to_device`) when room can be made, else serves a temporary copy.

With a remote tier (`remote.py`), a node leaving the last local tier first has the chunks of its
sequence that the server lacks queued for writing (`write_remote`), and chunks loaded from the
server join the tree on the device (`adopt`).

Not thread-safe: the store calls it under its lock.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hf_prefix_cache.model.states import ItemState, Run, Snapshot
from hf_prefix_cache.storage.disk import DiskTier
from hf_prefix_cache.storage.remote_chunks import queue_missing_chunks
from hf_prefix_cache.storage.segments import Segment
from hf_prefix_cache.storage.tiers import (
    DEVICE,
    DISK,
    HOST,
    NUM_TIERS,
    Mover,
    segment_to_device,
    segment_to_host,
    snapshot_to_host,
)
from hf_prefix_cache.tree.policy import CostAwarePolicy, LRUPolicy
from hf_prefix_cache.tree.radix import Node, RadixTree

if TYPE_CHECKING:
    from hf_prefix_cache.storage.remote import RemoteTier

logger = logging.getLogger("hf_prefix_cache")


@dataclass(slots=True)
class PlacementCounters:
    evictions: int = 0
    evicted_bytes: int = 0
    offloads: int = 0
    reloads: int = 0
    disk_writes: int = 0
    skipped_files: int = 0
    num_snapshots: int = 0
    failed_moves: int = 0


class Placement:
    """Moves nodes of `tree` between tiers to keep each within `budgets[tier]` bytes.

    Args:
        tree: the store's tree (values are `Segment`s).
        budgets: bytes allowed per tier (device, host, disk); 0 switches a tier off.
        mover: copies tensors between devices and host memory.
        disk: the disk tier, or None.
        policy: decides which node leaves first; told when one does.
        state_device: the device a stateful layer's snapshot goes back to.
        remote: the shared tier below the local ones, or None.
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
        self._indexed: set[str] = set()
        self._failures: set[tuple[object, ...]] = set()  # kinds of failed moves already logged as warnings

    # ------------------------------------------------------------ new entries
    def place_run(
        self, run: Run, matched: Sequence[Node[Segment]], matched_len: int, length: int, may_move: bool
    ) -> None:
        """Make `run` (positions `[0, length)`) back the new leaf without holding a second copy of the prefix.

        When the matched nodes are on the device and their runs back nothing else, they move
        onto `run` and their old tensors are freed: restores along this path stay one view.
        Otherwise only the new tail `[matched_len, length)` is kept, copied out so the prefix
        copy can be freed.
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
            self.add_to_file(node, snaps)
        for state in items:
            node = _holder(path, state.length)
            if node is None:
                continue
            seg = node.value
            assert seg is not None
            if state.length not in seg.items and node.tier != DISK:
                seg.items[state.length] = state if node.tier == DEVICE else snapshot_to_host(state, self.mover)
                self.tree.refresh_nbytes(node)

    def drop_corrupt(self, path: Sequence[Node[Segment]], exc: Exception) -> None:
        """Drop the node of `path` whose file `exc` names (it failed its checks on loading)."""
        bad = next(
            n for n in path if n.value is not None and n.value.disk is not None and str(n.value.disk.path) in str(exc)
        )
        logger.warning("dropping a stored prefix whose file is unusable: %s", exc)
        self.counters.skipped_files += 1
        self.drop(bad)

    def clear(self) -> None:
        """Forget every node (the caller clears the tree): delete their files, zero the snapshot count."""
        removed = self.tree.clear()
        refs = {id(n.value.disk): n.value.disk for n in removed if n.value is not None and n.value.disk}
        for ref in refs.values():
            if self.disk is not None and ref is not None:
                self.disk.delete(ref.path)
        self.counters.num_snapshots = 0

    def reset_counters(self) -> None:
        """Zero the counters `CacheStats` reports as events (`num_snapshots` counts what is held, so it stays)."""
        c = self.counters
        c.evictions = c.evicted_bytes = c.offloads = c.reloads = c.skipped_files = c.failed_moves = 0
        if self.remote is not None:
            self.remote.reset_counters()

    # ------------------------------------------------------------ budgets
    def enforce(self) -> None:
        """Bring every tier within its budget (as far as unlocked nodes allow)."""
        for tier in range(NUM_TIERS):
            self._shrink(tier, self.budgets[tier])

    def make_room(self, tier: int, nbytes: int) -> bool:
        """Move nodes out of `tier` until `nbytes` more fit in its budget; False when they cannot."""
        if nbytes > self.budgets[tier]:
            return False
        self._shrink(tier, self.budgets[tier] - nbytes)
        self.enforce()
        return self.tree.tier_nbytes[tier] + nbytes <= self.budgets[tier]

    def free_device(self) -> None:
        """Move every unlocked node off the device (after an out-of-memory error)."""
        self._shrink(DEVICE, 0)
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

    def _shrink(self, tier: int, target: int) -> None:
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
                if self._move(node, slower):
                    self.tree.offer(node)
                    return True
                failed = True
        if failed:
            return False
        self.write_remote(node)
        self.drop(node)
        return True

    def _move(self, node: Node[Segment], to: int) -> bool:
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
                ("device", "host", "disk")[to],
                exc,
            )
            return False
        self._release(node, seg)
        self.counters.num_snapshots += len(new.snapshots)
        self.tree.set_value(node, new)
        self.tree.set_tier(node, to)
        self.counters.offloads += 1
        logger.debug("moved tokens [%d, %d) to the %s tier", node.start, node.end, ("device", "host", "disk")[to])
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
        """`seg` (the value `node` held) no longer backs it: drop its references to runs and files.

        A run or file still read by other segments is cut down to what they cover, so held bytes
        stay equal to counted bytes. The removed part is always the tail of its run (runs are laid
        along a path, and nodes leave bottom-up).
        """
        self.counters.num_snapshots -= len(seg.snapshots)
        if seg.run is not None:
            seg.run.give_back(seg.start, seg.end)
        ref = seg.disk
        if ref is not None and self.disk is not None:
            ref.num_refs -= 1
            if ref.num_refs == 0:
                self.disk.delete(ref.path)
            else:
                self._rewrite_rest(above if above is not None else node.parent, seg)

    def _rewrite_rest(self, start: Node[Segment] | None, gone: Segment) -> None:
        """A split disk file lost one part: rewrite the part still used (an ancestor) so the file holds only that."""
        assert self.disk is not None and gone.disk is not None
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
        assert self.disk is not None and seg is not None and seg.disk is not None, f"{node} is not on disk"
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
            held = [*host.snapshots.values(), *host.items.values()]
            states = {layer: self.state_device(layer) for snap in held for layer in snap.states}
            device_seg = segment_to_device(host, self.mover, states)
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
        if not above or max(node.tier for node in above) == DEVICE:
            return
        self.tree.lock(leaf)
        try:
            self.bring_to_device(above, leaf.start)
        finally:
            self.tree.unlock(leaf)
        slowest = max(node.tier for node in above)
        if slowest != DEVICE and leaf.parent is not None and leaf.tier < slowest:
            if leaf.nbytes > self.budgets[slowest] or not self._move(leaf, slowest):
                self.drop(leaf)
            else:
                self.tree.offer(leaf)

    # ------------------------------------------------------------ remote tier
    def write_remote(self, node: Node[Segment]) -> None:
        """Queue the whole chunks of `node`'s sequence that the remote tier lacks (sent by `RemoteTier.flush`)."""
        if self.remote is not None:
            queue_missing_chunks(self.tree, self.remote, self.disk, node)

    def adopt(self, namespace: str, symbols: Sequence[Hashable], hit: Segment) -> bool:
        """Add chunks loaded from the remote tier (host segment `hit`, positions `[lo, hi)` of `symbols`) to the tree.

        Only the part past the local match is added, as a new leaf on the device (tiers kept
        monotone by `settle`, budgets by `enforce`). Returns whether anything was added.
        """
        have = self.tree.match(namespace, symbols[: hit.end]).matched_len
        if not hit.start <= have < hit.end:
            return False  # the local tree grew past it, or lost the prefix it continues meanwhile
        part = hit
        if have > hit.start:
            if hit.run is not None:
                hit.run.compact(have, hit.end)
            snapshots = {n: s for n, s in hit.snapshots.items() if n > have}
            items = {n: s for n, s in hit.items.items() if n > have}
            part = Segment(hit.run, have, hit.end, hit.nbytes_per_token, snapshots, items=items)
        if part.nbytes > max(self.budgets):
            logger.info("not adopting %d remote tokens: larger than every tier's budget", part.end - part.start)
            return False
        held = [*part.snapshots.values(), *part.items.values()]
        states = {layer: self.state_device(layer) for snap in held for layer in snap.states}
        targets = [*(part.run.devices if part.run is not None else []), *states.values()]
        if all(d is None or d.type == "cpu" for d in targets):
            device_seg = part  # a CPU model: the loaded host tensors are already where they are used
        else:
            device_seg = segment_to_device(part, self.mover, states)
        result = self.tree.insert(namespace, symbols[: hit.end], lambda a, b: device_seg, tier=DEVICE)
        assert result.new_node is not None and result.matched_len == have, (
            f"adopted at {result.matched_len}, not {have}"
        )
        self.counters.num_snapshots += len(device_seg.snapshots)
        leaf = result.path[-1]
        self.tree.lock(leaf)  # the request that asked for it restores it next
        try:
            self.settle(result.path)
            self.enforce()
        finally:
            self.tree.unlock(leaf)
        return True

    # ------------------------------------------------------------ disk index and save
    def index_disk(self, namespace: str) -> None:
        """Add the disk files of `namespace` to the tree, once per namespace and process."""
        if self.disk is None or namespace in self._indexed:
            return
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
        self.enforce()

    def save(self) -> int:
        """Move every unlocked node in memory to disk (bottom-up); returns how many moved."""
        if self.disk is None:
            return 0
        moved = 0
        for tier in (DEVICE, HOST):
            kept: list[Node[Segment]] = []
            while True:
                node = self.tree.pop_victim(tier)
                if node is None:
                    break
                if node.nbytes > self.budgets[DISK] or not self._move(node, DISK):
                    kept.append(node)  # stays in memory: a failed or too small disk must not lose it
                    continue
                moved += 1
                self._shrink(DISK, self.budgets[DISK])
            for node in kept:
                self.tree.offer(node)
        return moved


def _holder(path: Sequence[Node[Segment]], length: int) -> Node[Segment] | None:
    """The node of `path` whose range `(start, end]` holds `length`."""
    return next((node for node in path if node.start < length <= node.end), None)


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
