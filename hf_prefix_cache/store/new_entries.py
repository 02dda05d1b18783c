"""New entries: a finished sequence joining the tree (`insert_sequence`), in named steps.

Outside the store's lock the working cache hands over what it keeps (`WorkingCache.captured`:
its run, the copy of the positions this request computed and its snapshots, checked finite);
under it the sequence is matched once more, inserted, and its run shared with the stored prefix
or cut to its own positions (`segments.share_run`: the storage layer holds and frees the
tensors); each snapshot and media item state goes to the node of the new path that holds it,
copied onto that node's tier by the tier (`attach_states`). Budgets are kept once, after all of
it; steps with nothing to do are not called (state attachment without states, settling a leaf
under ancestors on the device, budgets no tier exceeds).

The store's lock is held twice (before the capture and after it), as `StoreLock.raw` with the
lock's follow-up steps made here only when the store is not `quiet` (see `locking.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from hf_prefix_cache import reasons
from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.keys.prefix_key import PrefixKey
from hf_prefix_cache.model.profile import ModelProfile
from hf_prefix_cache.model.states import Captured, ItemState, Snapshot
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.storage.memory import DeviceTier, HostTier
from hf_prefix_cache.storage.segments import Segment, share_run
from hf_prefix_cache.storage.tiers import DEVICE, DISK, HOST
from hf_prefix_cache.store.contract import InsertOutcome
from hf_prefix_cache.store.counters import RequestCounters
from hf_prefix_cache.store.disk_nodes import DiskNodes
from hf_prefix_cache.store.locking import StoreLock
from hf_prefix_cache.store.options import Options
from hf_prefix_cache.store.pins import Pins
from hf_prefix_cache.store.placement import Placement
from hf_prefix_cache.store.prefixes import on_device
from hf_prefix_cache.store.sessions import Session
from hf_prefix_cache.store.upkeep import StateDevices, Upkeep
from hf_prefix_cache.tree.radix import Node, RadixTree

logger = logging.getLogger("hf_prefix_cache")


class NewEntries:
    """A store's `insert_sequence` over the parts it is handed (as `prefixes.Prefixes` is for `acquire`).

    Args:
        profile: what the model's layers can do (the one profile the store and the hook share).
        options: the store's settings; `min_store_len`, `max_entries` and `remote_write` are read here.
        tree: the store's radix tree of `Segment`s.
        placement: which tier each node sits on; keeps the budgets after an insert.
        lock: the store's one lock owner (`locking.py`).
        pins: named pins and open sessions (an insert through a session moves its pin).
        requests: the request counters (skipped inserts, warnings logged once).
        upkeep: disk indexing and TTL expiry before a match.
        devices: where stateful layers' states live (learned from the snapshots captured here).
    """

    def __init__(
        self,
        profile: ModelProfile,
        options: Options,
        *,
        tree: RadixTree[Segment],
        placement: Placement,
        lock: StoreLock,
        pins: Pins,
        requests: RequestCounters,
        upkeep: Upkeep,
        devices: StateDevices,
    ) -> None:
        self.profile = profile
        self.min_store_len = options.min_store_len
        self.max_entries = options.max_entries
        self.remote_write = options.remote_write
        self._tree = tree
        self._placement = placement
        self._lock = lock
        self._pins = pins
        self._requests = requests
        self._upkeep = upkeep
        self._devices = devices
        device, host = placement.tiers[DEVICE], placement.tiers[HOST]
        if not isinstance(device, DeviceTier) or not isinstance(host, HostTier):
            raise TypeError(f"the memory tiers are {device.name} and {host.name}, not a DeviceTier and a HostTier")
        self._memory = (device, host)

    def insert_sequence(
        self,
        key: PrefixKey,
        cache: WorkingCache,
        snapshots: Sequence[Snapshot] = (),
        *,
        row: int | None = None,
        session: Session | None = None,
        items: Sequence[ItemState] = (),
        computed_from: int = 0,
    ) -> InsertOutcome:
        """Store the states in `cache` for the key's `symbols` (all of them), plus earlier `snapshots`.

        Positions from `computed_from` on, `snapshots` and `items` were computed by this request:
        if any of them holds NaN or infinity (a poisoned image, an adapter gone wrong), nothing
        is stored, since later requests sharing the prefix would inherit it; the skip is counted
        as `non_finite_states`.

        `row` picks one row of a batched cache; its new tokens are then always copied out,
        since the batch's tensors hold every row. `session`, when given, pins the stored entry.
        `items` are media item states, each kept by the node holding its placeholder's end
        (nodes that already hold one keep theirs).
        """
        namespace, tokens = key.namespace, key.symbols
        length = len(tokens)
        if length == 0:
            return InsertOutcome(0)
        if length < self.min_store_len:
            return self._skip(reasons.ENTRY_BELOW_MIN_STORE_LEN)
        if row is not None and self.profile.has_state:
            raise InconsistentStateError("batched inserts are for attention-only models")
        stored_len = self._stored_len(
            namespace, tokens, length, session, touch=not self.profile.has_state and not items
        )
        if stored_len is None:
            return InsertOutcome(0)  # an exact repeat: nothing new to capture
        capture = cache.captured(length, row=row, snapshots=snapshots, items=items, computed_from=computed_from)
        if capture is None:
            self._requests.log_once(
                reasons.NON_FINITE_STATES,
                "not storing %d tokens: their states hold NaN or infinity (check the inputs, e.g. pixel values)",
                length,
            )
            return self._skip(reasons.NON_FINITE_STATES)
        if capture.snapshots:  # where stateful layers' states live, for bringing them back
            self._devices.remember(capture.snapshots[-1])
        if items:
            self._devices.remember(items[0])
        lock = self._lock
        with lock.raw:
            if self._upkeep.active:
                self._upkeep.maintain(namespace)
            too_large = self._too_large(length - stored_len, capture, items, stored_len)
            matched_len = length if too_large else self._place(namespace, tokens, length, capture, items, row, session)
            if not lock.quiet:
                lock.check_pressure()
        if not lock.quiet:
            lock.after_unlock()
        if too_large:
            return self._skip(reasons.ENTRY_OVER_BUDGET)
        if length > matched_len:
            logger.info("prefix cache: stored %d new tokens (%d in all)", length - matched_len, length)
        return InsertOutcome(length - matched_len)

    def _too_large(self, num_new: int, capture: Captured, items: Sequence[ItemState], matched_len: int) -> bool:
        """Whether `num_new` new tokens (after `matched_len` stored ones) are larger than every tier's budget.

        `matched_len` is the match made before capturing (`_stored_len`), so the sequence is compared
        with the tree once less: should the tree change in between, the estimate only decides whether
        an oversized entry is refused here or dropped by the budgets right after it is placed.
        """
        new_nbytes = num_new * capture.nbytes_per_token
        if capture.snapshots:
            new_nbytes += sum(s.nbytes for s in capture.snapshots)
        if items:
            new_nbytes += sum(s.nbytes for s in items if s.length > matched_len)
        largest = max(self._placement.budgets)  # it lands on the device, then moves to a tier that holds it
        if new_nbytes <= largest:
            return False
        logger.info(
            "not storing %d new tokens (%d bytes): larger than every tier's budget (at most %d)",
            num_new,
            new_nbytes,
            largest,
        )
        return True

    def _place(
        self,
        namespace: str,
        tokens: Sequence[Any],
        length: int,
        capture: Captured,
        items: Sequence[ItemState],
        row: int | None,
        session: Session | None,
    ) -> int:
        """Insert the captured states into the tree and its tiers, then keep every budget (under the lock).

        Returns:
            How many leading tokens were stored already (the match the insert extended).
        """
        run, per_token = capture.run, capture.nbytes_per_token
        result = self._tree.insert(namespace, tokens, lambda a, b: Segment(run, a, b, per_token))
        leaf = result.new_node
        before = on_device(result.path[:-1]) if leaf is not None else None
        if leaf is not None and leaf.value is not None:
            share_run(leaf.value, before if row is None else None, capture.tail)  # a batch row's run holds every row
        if capture.snapshots or items:  # counted after: attaching to a disk node counts its file's snapshots itself
            added = attach_states(
                self._tree, self._memory, self._placement.files, result.path, capture.snapshots, items
            )
            self._placement.counters.num_snapshots += added
        self._tree.touch(result.path)
        if leaf is not None:
            if before is None:  # an ancestor is off the device: tiers stay monotone
                self._placement.settle(result.path)
            if self.remote_write == "through":
                self._placement.write_remote(result.path[-1])
        if session is not None and result.path:
            self._pins.hold(session, result.path[-1])
        for held, budget in zip(self._tree.tier_nbytes, self._placement.budgets, strict=True):
            if held > budget:  # a tier over its budget: its least valuable nodes move down
                self._placement.enforce()
                break
        if self.max_entries is not None and self._tree.num_leaves > self.max_entries:
            self._placement.drop_leaves(self._tree.num_leaves - self.max_entries)
        return result.matched_len

    def _stored_len(
        self, namespace: str, tokens: Sequence[Any], length: int, session: Session | None, touch: bool
    ) -> int | None:
        """How many leading `tokens` (`length` of them) are stored; None when all are and `touch` marked them used
        (held by `session`)."""
        lock = self._lock
        with lock.raw:
            if self._upkeep.active:
                self._upkeep.maintain(namespace)
            match = self._tree.match(namespace, tokens)
            repeat = touch and match.matched_len == length and match.path and match.path[-1].end == length
            if repeat:
                self._tree.touch(match.path)
                if session is not None:
                    self._pins.hold(session, match.path[-1])
        if not lock.quiet:
            lock.after_unlock()
        return None if repeat else match.matched_len

    def _skip(self, reason: str) -> InsertOutcome:
        self._requests.event(reason)
        return InsertOutcome(0, skipped=reason)


def attach_states(
    tree: RadixTree[Segment],
    memory: tuple[DeviceTier, HostTier],
    files: DiskNodes | None,
    path: Sequence[Node[Segment]],
    snapshots: Sequence[Snapshot],
    items: Sequence[ItemState],
) -> int:
    """Give each snapshot and media item state to the node of `path` whose range holds its length.

    A node that holds one at that length keeps its own. A node in memory takes them through its
    tier (`add_states`: a host node takes copies in host memory); a node on disk has its file
    rewritten once with all of its new snapshots (an item state alone does not rewrite a file). Budgets
    are enforced by the caller after all are attached: enforcing after each one sent the
    entry to disk after its first snapshot and lost the rest. Returns how many snapshots were added.
    """
    added = 0
    new: dict[int, tuple[Node[Segment], dict[int, Snapshot], dict[int, ItemState]]] = {}
    for snap in snapshots:
        node = _holder(path, snap.length)
        if node is not None and node.value is not None and snap.length not in node.value.snapshots:
            new.setdefault(id(node), (node, {}, {}))[1].setdefault(snap.length, snap)
    for state in items:
        node = _holder(path, state.length)
        if node is not None and node.value is not None and state.length not in node.value.items and node.tier != DISK:
            new.setdefault(id(node), (node, {}, {}))[2].setdefault(state.length, state)
    for node, snaps, states in new.values():
        assert node.value is not None
        if node.tier == DISK:
            assert files is not None, "a disk node in a store without a disk tier"
            files.add_to_file(node, list(snaps.values()))
            continue
        memory[node.tier].add_states(node.value, list(snaps.values()), list(states.values()))
        added += len(snaps)
        tree.refresh_nbytes(node)
    return added


def _holder(path: Sequence[Node[Segment]], length: int) -> Node[Segment] | None:
    """The node of `path` whose range `(start, end]` holds `length`."""
    return next((node for node in path if node.start < length <= node.end), None)
