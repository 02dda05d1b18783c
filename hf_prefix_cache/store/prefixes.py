"""Prefixes: the hot path of a store: `acquire`, `release` and `insert_sequence`, each as named steps.

`acquire`: fetch from the remote tier on a local miss, then (under the lock) match, pin the
matched path, bring it to the device and plan what to restore, then (outside it) restore into
the caller's working cache. `insert_sequence`: check what is worth storing, capture the states
(outside the lock), then place them in the tree without a second copy of the prefix.

Each verb holds the store's lock once per phase (`acquire` and `release` once, `insert_sequence`
twice: before and after the capture, which runs outside it), holding `StoreLock.raw` directly and
making the lock's two follow-up steps itself only when the store is not `quiet` (see
`locking.py`). Steps with nothing to do are not called: upkeep only where there is a disk tier or a
ttl, the remote fetch only with a remote tier, state attachment only with states to attach.

Composed, not inherited: `TreeStore` builds the tree, its placement, lock, pins, counters and
upkeep, hands them to `Prefixes` in its constructor, and exposes these verbs as its own (they are
the contract's, `contract.Store`: their signatures are written here and in the protocol only).
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
from hf_prefix_cache.model.landing import Landing, land_all
from hf_prefix_cache.model.profile import ModelProfile
from hf_prefix_cache.model.states import ItemState, Run, Snapshot, all_finite, state_tensors
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.multimodal.media import clamp_below_spans
from hf_prefix_cache.storage.codec import CorruptFileError
from hf_prefix_cache.storage.mover import is_out_of_memory
from hf_prefix_cache.storage.segments import (
    KVPieces,
    Segment,
    best_snapshot,
    join_kv,
    kv_pieces,
    landings,
    stored_item_states,
)
from hf_prefix_cache.store.contract import InsertOutcome, Lease
from hf_prefix_cache.store.counters import RequestCounters
from hf_prefix_cache.store.locking import StoreLock
from hf_prefix_cache.store.options import Options
from hf_prefix_cache.store.pins import Pins
from hf_prefix_cache.store.placement import Placement, place_run
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


@dataclass(slots=True)
class _Capture:
    """What `insert_sequence` captured from a working cache, outside the lock."""

    run: Run | None
    snapshots: list[Snapshot]
    nbytes_per_token: int
    tail: Run | None = None  # a packed copy of the positions this request computed, checked finite


class Prefixes:
    """A store's hot path over the parts it is handed: `acquire`, `release`, `insert_sequence`.

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
        without one. A disk file found corrupt is dropped and the match retried. `overlap`: see `_restore`.

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
            self._restore(into, plan, batch_size, overlap)
        except BaseException as exc:
            if plan is not None:
                with self._lock():
                    self._unpin(plan.pin)
                    if isinstance(exc, InconsistentStateError):
                        self._drop_inconsistent(plan.pin.node, exc)
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

    def _restore(self, into: WorkingCache, plan: _Plan, batch_size: int, overlap: bool) -> None:
        """Outside the lock: join the pieces (a copy only across runs) and restore them into `into`.

        With `overlap`, where the model allows (`WorkingCache.restore(landing=...)`), pieces still
        landing from host memory, or lying in several runs, restore layer by layer at first use:
        copies overlap the prefill, and the layer's own concatenation joins the pieces (a join
        here would copy the whole prefix once more). Elsewhere every copy lands first. The views
        stay valid: a compaction swaps a run's tensors for new ones and never writes into the old ones.
        """
        if not plan.restore_len:
            return
        if overlap and plan.pieces and (plan.landings or len(plan.pieces) > 1) and into.defers_keys:
            logger.debug(
                "restoring %d tokens from %d pieces layer by layer at first use", plan.restore_len, len(plan.pieces)
            )
            landing = (plan.pieces, plan.landings)
            into.restore(plan.restore_len, None, None, None, batch_size=batch_size, landing=landing)
        else:
            if plan.landings:
                logger.debug(
                    "restoring %d tokens after every copy from host memory has landed (%s)",
                    plan.restore_len,
                    "not a model whose layers can be set at first use" if overlap else "a lookup",
                )
                land_all(plan.landings)
            keys, values = join_kv(plan.pieces) if self.profile.has_kv else (None, None)
            into.restore(plan.restore_len, keys, values, plan.snapshot, batch_size=batch_size, items=plan.items)

    def release(self, lease: Lease) -> None:
        """Unpin the lease's entry; a second call does nothing."""
        with self._lock.raw:
            self._unpin(lease.pin)
        if not self._lock.quiet:
            self._lock.after_unlock()

    def _drop_inconsistent(self, node: Node[Segment] | None, exc: InconsistentStateError) -> None:
        """A restore from `node`'s path failed an exactness guard: drop the node (unless a request holds a lease in
        its subtree) so that no later request restores it again (under the lock; the hook runs the call cold)."""
        if node is not None and node.lock_ref == 0:
            logger.info("dropping a stored prefix whose restore failed an exactness guard: %s", exc)
            self._placement.drop(node)

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
        capture = self._capture(cache, length, row, snapshots, items, computed_from)
        if capture is None:
            return self._skip(reasons.NON_FINITE_STATES)
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

    def _capture(
        self,
        cache: WorkingCache,
        length: int,
        row: int | None,
        snapshots: Sequence[Snapshot],
        items: Sequence[ItemState],
        computed_from: int,
    ) -> _Capture | None:
        """The cache's states of `[0, length)` (one `row` of a batch) and its snapshots; None if not finite."""
        start = min(computed_from, length)
        # After a restored prefix the tree likely keeps just the new positions: they are copied out once (one
        # stack) and the check reads that copy; a chat turn whose prefix moves onto this run drops the copy.
        run, tail = cache.capture(length, row, start if start > 0 else None) if self.profile.has_kv else (None, None)
        all_snapshots = list(snapshots)
        if self.profile.has_state:
            all_snapshots.append(cache.snapshot(length))
            self._devices.remember(all_snapshots[-1])
            all_snapshots = cache.merge_windows(all_snapshots)  # window mode: touching windows held once
        if items:
            self._devices.remember(items[0])
        if tail is not None:
            fresh: list[torch.Tensor | None] = list(tail.buffers)
        elif run is not None:  # nothing restored: every position is new, and the run holds exactly those
            fresh = [*run.keys, *run.values]
        else:
            fresh = []
        if not all_finite([*fresh, *state_tensors(all_snapshots), *state_tensors(items)]):
            self._requests.log_once(
                reasons.NON_FINITE_STATES,
                "not storing %d tokens: their states hold NaN or infinity (check the inputs, e.g. pixel values)",
                length,
            )
            return None
        return _Capture(run, all_snapshots, run.nbytes_per_token if run is not None else 0, tail)

    def _too_large(self, num_new: int, capture: _Capture, items: Sequence[ItemState], matched_len: int) -> bool:
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
        capture: _Capture,
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
        if run is not None and result.new_node is not None:
            run.take()
            place_run(run, result.path[:-1], result.matched_len, length, may_move=row is None, tail=capture.tail)
        if capture.snapshots or items:
            self._placement.attach_states(result.path, capture.snapshots, items)
        self._tree.touch(result.path)
        if result.new_node is not None:
            self._placement.settle(result.path)
            if self.remote_write == "through":
                self._placement.write_remote(result.path[-1])
        if session is not None and result.path:
            self._pins.hold(session, result.path[-1])
        self._placement.enforce()
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
