"""Prefixes: a store's hot verbs as named steps: leases (`acquire`, `release`) and new entries (`insert_sequence`).

`acquire`: fetch from the remote tier on a local miss, then (under the lock) match, pin the matched
path, bring it to the device and plan what to restore, then (outside it) restore into the caller's
working cache (`segments.restore_pieces`). `release` lets the pin go. `insert_sequence`: outside
the lock the working cache hands over what it keeps (`WorkingCache.captured`: its run, the copy of
the positions this request computed and its snapshots, checked finite); under it the sequence is
matched once more, inserted, its run shared with the stored prefix or cut to its own positions
(`segments.share_run`), its states attached to the nodes that hold them (`Placement.attach_states`),
and budgets kept once, after all of it.

Each verb holds the store's lock once per phase, as `StoreLock.raw`, making the lock's two follow-up
steps itself only when the store is not `quiet` (see `locking.py`). Steps with nothing to do are not
called: upkeep only with a disk tier or a ttl, the remote fetch only with a remote tier, bringing a
path back or settling a new leaf only when a node of it is off the device (`on_device`), state
attachment without states, budgets no tier exceeds. The three verbs a hit calls share this module.

Composed, not inherited: `TreeStore` builds the tree, its placement, lock, pins, counters and upkeep,
hands them to `Prefixes` and exposes its verbs as its own (they are the contract's, `contract.Store`:
their signatures are written here and in the protocol only).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_prefix_cache import reasons
from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.keys.prefix_key import PrefixKey
from hf_prefix_cache.model.landing import Landing
from hf_prefix_cache.model.profile import ModelProfile
from hf_prefix_cache.model.states import Captured, ItemState, Snapshot
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.multimodal.media import clamp_below_spans
from hf_prefix_cache.storage.codec import CorruptFileError
from hf_prefix_cache.storage.mover import is_out_of_memory
from hf_prefix_cache.storage.segments import (
    KVPieces,
    Segment,
    best_snapshot,
    kv_pieces,
    landings,
    restore_pieces,
    share_run,
    stored_item_states,
)
from hf_prefix_cache.storage.tiers import DEVICE
from hf_prefix_cache.store.contract import InsertOutcome, Lease
from hf_prefix_cache.store.counters import RequestCounters
from hf_prefix_cache.store.locking import StoreLock
from hf_prefix_cache.store.options import Options
from hf_prefix_cache.store.pins import Pins
from hf_prefix_cache.store.placement import Placement
from hf_prefix_cache.store.sessions import Session
from hf_prefix_cache.store.upkeep import StateDevices, Upkeep
from hf_prefix_cache.tree.radix import Node, RadixTree

logger = logging.getLogger("hf_prefix_cache")


class _Pin:
    """A lease's hold on the deepest node of its matched path (None: nothing matched)."""

    __slots__ = ("node", "released")

    def __init__(self, node: Node[Segment] | None) -> None:
        self.node = node
        self.released = False


@dataclass(slots=True)
class _Plan:
    """What `acquire` decided under the lock: the pinned path and the states to restore from it."""

    pin: _Pin
    matched_len: int
    restore_len: int
    snapshot: Snapshot | None
    items: list[ItemState]
    pieces: KVPieces
    landings: list[Landing]  # copies into `pieces` still on their way (a prefix brought back from host memory)


class Prefixes:
    """A store's hot verbs over the parts it is handed: `acquire`, `release`, `insert_sequence` (and `relieve_device`).

    Args:
        profile: what the model's layers can do (the one profile the store and the hook share).
        options: the store's settings; `min_store_len`, `max_entries` and `remote_write` are read here.
        tree: the store's radix tree of `Segment`s.
        placement: which tier each node sits on; the only caller of the tree's eviction verbs.
        lock: the store's one lock owner (`locking.py`).
        pins: named pins and open sessions (an insert through a session moves its pin).
        requests: the request counters (skipped inserts, warnings logged once).
        upkeep: disk indexing, TTL expiry and remote fetches around a match.
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

    def relieve_device(self) -> None:
        """Move every unpinned entry off the device (after an out-of-memory error)."""
        with self._lock():
            self._placement.free_device()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ acquire
    def acquire(
        self,
        key: PrefixKey,
        into: WorkingCache,
        *,
        limit: int | None = None,
        batch_size: int = 1,
        overlap: bool = False,
    ) -> Lease:
        """Match `key`, pin the matched path, restore the usable prefix into `into` (see `contract.Store`).

        Restores at most `limit` symbols (default: all but the last, which is fed for its logits),
        never cutting inside one of the key's media `spans`. Media items whose spans are in its
        `item_spans` restore with their stored item states; a prefix is cut before the first such item it holds
        without one. A disk file found corrupt is dropped and the match retried. `overlap`: see
        `segments.restore_pieces`.

        Raises:
            InconsistentStateError: the stored prefix failed an exactness guard as it was restored; nothing stays
                pinned, and its deepest matched node is dropped (unless another request holds it).
            torch.OutOfMemoryError: bringing the entry back or restoring it did not fit; nothing stays pinned,
                and every unpinned entry has been moved off the device, so a second attempt (into a fresh
                working cache) may fit.
        """
        namespace, spans, item_spans = key.namespace, key.spans, key.item_spans
        tokens: Sequence[Any] = key.symbols  # the tree compares any hashable symbols
        if limit is None:
            limit = len(tokens) - 1
        if self._placement.remote is not None:
            self._upkeep.fetch_remote(namespace, tokens, limit)
        lock = self._lock
        plan = None
        try:
            while plan is None:
                with lock.raw:
                    plan = self._plan(namespace, tokens, limit, spans, item_spans)
                    if not lock.quiet:
                        lock.check_pressure()
                if not lock.quiet:
                    lock.after_unlock()
            if plan.restore_len:  # outside the lock
                pieces, pending = plan.pieces, plan.landings
                restore_pieces(into, plan.restore_len, pieces, pending, plan.snapshot, plan.items, batch_size, overlap)
        except BaseException as exc:
            if plan is not None:
                with self._lock():
                    self._unpin(plan.pin)
                    if isinstance(exc, InconsistentStateError):
                        self._placement.drop_inconsistent(plan.pin.node, exc)
            if is_out_of_memory(exc):
                self.relieve_device()  # so that the caller's next attempt finds room
            raise
        return Lease(namespace, plan.restore_len, plan.matched_len, len(plan.items), plan.pin)

    def _plan(
        self,
        namespace: str,
        tokens: Sequence[Any],
        limit: int,
        spans: Sequence[tuple[int, int]],
        item_spans: Sequence[tuple[int, int]],
    ) -> _Plan | None:
        """Under the lock: match, pin, bring the prefix to the device, pick its states (None: retry)."""
        if self._upkeep.active:
            self._upkeep.maintain(namespace)
        match = self._tree.match(namespace, tokens)
        restore_len = min(match.matched_len, limit)
        if spans:  # never inside a medium: its placeholders are fed together
            restore_len = clamp_below_spans(restore_len, spans)
        if self.profile.has_state:
            restore_len, _ = best_snapshot([n.value for n in match.path if n.value is not None], restore_len)
        pin = _Pin(match.path[-1] if match.path else None)
        if pin.node is not None:
            self._tree.lock(pin.node)
        try:
            segments = on_device(match.path)
            if segments is None:  # a node off the device: brought back (or copied for this request)
                segments = self._placement.bring_to_device(match.path, restore_len)
        except CorruptFileError as exc:
            self._unpin(pin)
            self._placement.drop_corrupt(match.path, exc)
            return None
        except BaseException:
            self._unpin(pin)
            raise
        snapshot = None
        if self.profile.has_state:
            found, snapshot = best_snapshot(segments, restore_len)
            if found != restore_len:
                self._unpin(pin)
                raise InconsistentStateError(f"snapshot at {found}, planned {restore_len}")
        items: list[ItemState] = []
        if item_spans:
            assert not self.profile.has_state, "item states are for attention-only models"
            restore_len, items = stored_item_states(segments, item_spans, restore_len)
        pieces = kv_pieces(segments, restore_len, land=False)
        return _Plan(pin, match.matched_len, restore_len, snapshot, items, pieces, landings(segments, restore_len))

    def release(self, lease: Lease) -> None:
        """Unpin the lease's entry; a second call does nothing."""
        with self._lock.raw:
            self._unpin(lease.pin)
        if not self._lock.quiet:
            self._lock.after_unlock()

    def _unpin(self, pin: _Pin) -> None:
        """The one place a lease's pin is let go (under the lock)."""
        if not pin.released:
            pin.released = True
            if pin.node is not None:
                self._tree.unlock(pin.node)

    # ------------------------------------------------------------------ insert
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
            # Larger than every tier's budget (it lands on the device, then moves to a tier that holds it)? Counted
            # from the match made before capturing: should the tree change meanwhile, the estimate only decides
            # whether an oversized entry is refused here or dropped by the budgets right after it is placed.
            new_nbytes = (length - stored_len) * capture.nbytes_per_token
            if capture.snapshots:
                new_nbytes += sum(s.nbytes for s in capture.snapshots)
            if items:
                new_nbytes += sum(s.nbytes for s in items if s.length > stored_len)
            too_large = new_nbytes > max(self._placement.budgets)
            matched_len = length if too_large else self._place(namespace, tokens, length, capture, items, row, session)
            if not lock.quiet:
                lock.check_pressure()
        if not lock.quiet:
            lock.after_unlock()
        if too_large:
            logger.info(
                "not storing %d new tokens (%d bytes): larger than every tier's budget (at most %d)",
                length - stored_len,
                new_nbytes,
                max(self._placement.budgets),
            )
            return self._skip(reasons.ENTRY_OVER_BUDGET)
        if length > matched_len:
            logger.info("prefix cache: stored %d new tokens (%d in all)", length - matched_len, length)
        return InsertOutcome(length - matched_len)

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
        if capture.snapshots or items:  # touched again (the insert touched it): a cost-aware score counts states
            self._placement.attach_states(result.path, capture.snapshots, items)
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


def on_device(nodes: Sequence[Node[Segment]]) -> list[Segment] | None:
    """The segments of `nodes` when every one is on the device (nothing to bring back), else None."""
    out: list[Segment] = []
    for node in nodes:
        if node.tier != DEVICE or node.value is None:
            return None
        out.append(node.value)
    return out
