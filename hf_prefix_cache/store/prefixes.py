"""Prefixes: the stored prefixes of one store: its tree and tiers, matched, pinned and filled under one lock.

The hot path of every request: `acquire` (match, pin, bring to the device, restore into a
working cache), `release`, and `insert` (capture a finished sequence's states and place them
without a second copy of the prefix). Also TTL expiry, the remote tier's fetch on a local miss,
and the work kept out of the lock (file deletions, remote writes, pressure callbacks).
`TreeStore` owns one and exposes these verbs as the store's contract.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from hf_prefix_cache import reasons
from hf_prefix_cache.model.profile import ModelProfile
from hf_prefix_cache.model.states import ItemState, Snapshot, all_finite, state_tensors
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.multimodal.media import clamp_below_spans
from hf_prefix_cache.storage.codec import CorruptFileError
from hf_prefix_cache.storage.placement import Placement
from hf_prefix_cache.storage.segments import Segment, best_snapshot, join_kv, kv_pieces, stored_item_states
from hf_prefix_cache.storage.tiers import TIER_NAMES
from hf_prefix_cache.store.contract import InsertOutcome, Lease
from hf_prefix_cache.store.counters import RequestCounters
from hf_prefix_cache.store.pins import Pins
from hf_prefix_cache.store.pressure import PressureMonitor
from hf_prefix_cache.store.sessions import Session
from hf_prefix_cache.tree.radix import Node, RadixTree

logger = logging.getLogger("hf_prefix_cache")


class _Pin:
    """A lease's hold on the deepest node of its matched path (None: nothing matched)."""

    __slots__ = ("node", "released")

    def __init__(self, node: Node[Segment] | None) -> None:
        self.node = node
        self.released = False


class StateDevices:
    """Where each stateful layer's states live (learned from the first snapshot), for bringing them back."""

    def __init__(self, default: torch.device | None) -> None:
        self._default = default
        self._devices: dict[int, torch.device] = {}

    def remember(self, snap: Snapshot) -> None:
        if len(self._devices) == len(snap.states):
            return
        for layer, state in snap.states.items():
            first = next((t for per in state.tensors.values() for t in per.values() if t is not None), None)
            if first is not None:
                self._devices[layer] = first.device

    def get(self, layer: int) -> torch.device | None:
        return self._devices.get(layer, self._default)


class Prefixes:
    """The tree of one store with its placement, pins and counters; every method takes the store's lock."""

    def __init__(
        self,
        profile: ModelProfile,
        tree: RadixTree[Segment],
        placement: Placement,
        devices: StateDevices,
        lock: threading.RLock,
        pins: Pins,
        requests: RequestCounters,
        pressure: PressureMonitor,
        *,
        ttl: float | None,
        min_store_len: int,
        max_entries: int | None,
        remote_write: str,
    ) -> None:
        self.profile = profile
        self._tree = tree
        self._placement = placement
        self._devices = devices
        self._lock = lock
        self._pins = pins
        self._requests = requests
        self._pressure = pressure
        self.ttl = ttl
        self.min_store_len = min_store_len
        self.max_entries = max_entries
        self.remote_write = remote_write
        self._next_expiry = 0.0

    def acquire(
        self,
        namespace: str,
        symbols: Sequence[Hashable],
        into: WorkingCache,
        *,
        limit: int | None = None,
        spans: Sequence[tuple[int, int]] = (),
        item_spans: Sequence[tuple[int, int]] = (),
        batch_size: int = 1,
    ) -> Lease:
        """Match `symbols`, pin the matched path, restore the usable prefix into `into` (see `contract.Store`).

        Restores at most `limit` symbols (default: all but the last, which is fed for its logits),
        never cutting inside one of the media `spans` (`[start, end)` positions). Media items
        whose spans are in `item_spans` (prompt order) restore with their stored item states; a
        prefix is cut before the first such item it holds without one. Entries off the device
        are brought back first; a disk file found corrupt is dropped and the match retried.

        Raises:
            torch.OutOfMemoryError: bringing the entry back or restoring it did not fit (nothing stays pinned).
        """
        tokens: Sequence[Any] = symbols  # the tree compares any hashable symbols
        if limit is None:
            limit = len(tokens) - 1
        if self._placement.remote is not None:
            self._fetch_remote(namespace, tokens, limit)
        pin = _Pin(None)
        try:
            while True:
                with self._lock:
                    self.maintain(namespace)
                    match = self._tree.match(namespace, tokens)
                    restore_len = clamp_below_spans(min(match.matched_len, limit), spans)
                    if self.profile.has_state:
                        restore_len, _ = best_snapshot(
                            [n.value for n in match.path if n.value is not None], restore_len
                        )
                    pin = _Pin(match.path[-1] if match.path else None)
                    if pin.node is not None:
                        self._tree.lock(pin.node)
                    try:
                        segments = self._placement.bring_to_device(match.path, restore_len)
                    except CorruptFileError as exc:
                        self._unpin(pin)
                        self._placement.drop_corrupt(match.path, exc)
                        continue
                    snapshot = None
                    if self.profile.has_state:
                        found, snapshot = best_snapshot(segments, restore_len)
                        assert found == restore_len, f"snapshot at {found}, planned {restore_len}"
                    items: list[ItemState] = []
                    if item_spans:
                        assert not self.profile.has_state, "item states are for attention-only models"
                        restore_len, items = stored_item_states(segments, item_spans, restore_len)
                    pieces = kv_pieces(segments, restore_len)
                    calls = self.pressure_calls()
                break
            self.after_unlock(calls)
            # Joining pieces may copy; outside the lock. The views stay valid: a compaction swaps a
            # run's tensors for new ones and never writes into the old ones.
            if restore_len:
                keys, values = join_kv(pieces) if self.profile.has_kv else (None, None)
                into.restore(restore_len, keys, values, snapshot, batch_size=batch_size, items=items)
        except BaseException:
            with self._lock:
                self._unpin(pin)
            raise
        return Lease(namespace, restore_len, match.matched_len, len(items), pin)

    def release(self, lease: Lease) -> None:
        """Unpin the lease's entry; a second call does nothing."""
        with self._lock:
            self._unpin(lease.pin)

    def insert(
        self,
        namespace: str,
        symbols: Sequence[Hashable],
        cache: WorkingCache,
        snapshots: Sequence[Snapshot] = (),
        *,
        row: int | None = None,
        session: Session | None = None,
        items: Sequence[ItemState] = (),
        computed_from: int = 0,
    ) -> InsertOutcome:
        """Store the states in `cache` for `symbols` (all of them), plus earlier `snapshots`.

        Positions from `computed_from` on, `snapshots` and `items` were computed by this request:
        if any of them holds NaN or infinity (a poisoned image, an adapter gone wrong), nothing
        is stored, since later requests sharing the prefix would inherit it; the skip is counted
        as `non_finite_states`.

        `row` picks one row of a batched cache; its new tokens are then always copied out,
        since the batch's tensors hold every row. `session`, when given, pins the stored entry.
        `items` are media item states, each kept by the node holding its placeholder's end
        (nodes that already hold one keep theirs).
        """
        tokens: Sequence[Any] = symbols
        length = len(tokens)
        if length == 0:
            return InsertOutcome(0)
        if length < self.min_store_len:
            return self._skip(reasons.ENTRY_BELOW_MIN_STORE_LEN)
        assert row is None or not self.profile.has_state, "batched inserts are for attention-only models"
        if not self.profile.has_state and not items and self._touch_if_stored(namespace, tokens, session):
            return InsertOutcome(0)  # an exact repeat: nothing new to capture
        run = cache.capture_run(length, row) if self.profile.has_kv else None
        all_snapshots = list(snapshots)
        if self.profile.has_state:
            all_snapshots.append(cache.snapshot(length))
            self._devices.remember(all_snapshots[-1])
            all_snapshots = cache.merge_windows(all_snapshots)  # window mode: touching windows held once
        if items:
            self._devices.remember(items[0])
        fresh = run.slice(min(computed_from, length), length) if run is not None else ([], [])
        if not all_finite([*fresh[0], *fresh[1], *state_tensors(all_snapshots), *state_tensors(items)]):
            self._requests.log_once(
                reasons.NON_FINITE_STATES,
                "not storing %d tokens: their states hold NaN or infinity (check the inputs, e.g. pixel values)",
                length,
            )
            return self._skip(reasons.NON_FINITE_STATES)
        nbytes_per_token = run.nbytes_per_token if run is not None else 0
        with self._lock:
            self.maintain(namespace)
            matched_len = self._tree.match(namespace, tokens).matched_len
            new_nbytes = (
                (length - matched_len) * nbytes_per_token
                + sum(s.nbytes for s in all_snapshots)
                + sum(s.nbytes for s in items if s.length > matched_len)
            )
            largest = max(self._placement.budgets)  # it lands on the device, then moves to a tier that holds it
            if new_nbytes > largest:
                logger.info(
                    "not storing %d new tokens (%d bytes): larger than every tier's budget (at most %d)",
                    length - matched_len,
                    new_nbytes,
                    largest,
                )
                return self._skip(reasons.ENTRY_OVER_BUDGET)
            result = self._tree.insert(namespace, tokens, lambda a, b: Segment(run, a, b, nbytes_per_token))
            if run is not None and result.new_node is not None:
                run.take()
                self._placement.place_run(run, result.path[:-1], result.matched_len, length, may_move=row is None)
            self._placement.attach_states(result.path, all_snapshots, items)
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
            calls = self.pressure_calls()
        self.after_unlock(calls)
        if length > result.matched_len:
            logger.info("prefix cache: stored %d new tokens (%d in all)", length - result.matched_len, length)
        return InsertOutcome(length - result.matched_len)

    def relieve_device(self) -> None:
        """Move every unpinned entry off the device (after an out-of-memory error)."""
        with self._lock:
            self._placement.free_device()
        self.after_unlock(())
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def has_entries(self, namespace: str) -> bool:
        """Whether the tree holds anything under `namespace` (disk files are not indexed for this)."""
        with self._lock:
            return namespace in self._tree.namespaces()

    def stored_len(self, namespace: str, tokens: Sequence[int]) -> int:
        """How many leading `tokens` are stored under `namespace` (indexing its disk files first)."""
        with self._lock:
            self._placement.index_disk(namespace)
            return self._tree.match(namespace, tokens).matched_len

    def pin_stored(self, namespace: str, tokens: Sequence[int]) -> bool:
        """Pin the stored prefix `tokens` on the device; False when not all of it is stored."""
        with self._lock:
            if self._tree.match(namespace, tokens).matched_len < len(tokens):
                return False
            path = self._tree.insert(namespace, tokens, _never_called).path
            if self._pins.add(namespace, tokens, path[-1]):
                # A pinned prefix lives on the device; bring back any part that was offloaded.
                self._placement.bring_to_device(path, len(tokens))
            return True

    def _unpin(self, pin: _Pin) -> None:
        """The one place a lease's pin is let go (under the lock)."""
        if not pin.released:
            pin.released = True
            if pin.node is not None:
                self._tree.unlock(pin.node)

    def _skip(self, reason: str) -> InsertOutcome:
        self._requests.event(reason)
        return InsertOutcome(0, skipped=reason)

    def _fetch_remote(self, namespace: str, tokens: Sequence[Any], limit: int) -> None:
        """On a local miss of at least one whole chunk, load the chunks the remote tier holds into the tree.

        The server is asked outside the lock; a server that cannot be asked is counted as the
        `remote_unavailable` event and the request goes on with the local tiers.
        """
        remote = self._placement.remote
        assert remote is not None
        last = min(limit, len(tokens)) // remote.chunk_len
        if last == 0:
            return
        with self._lock:
            self.maintain(namespace)
            have = self._tree.match(namespace, tokens).matched_len
        if have >= last * remote.chunk_len:
            return
        hit = remote.fetch(namespace, tokens, have // remote.chunk_len, last, need_snapshot=self.profile.has_state)
        if hit.error is not None:
            self._requests.event(hit.error)
        if hit.segment is None or hit.segment.end <= have:
            return
        with self._lock:
            self._placement.adopt(namespace, tokens, hit.segment)
            calls = self.pressure_calls()
        self.after_unlock(calls)

    def _touch_if_stored(self, namespace: str, tokens: Sequence[Any], session: Session | None) -> bool:
        """If all of `tokens` is stored already, mark it used (and held by `session`) and say so."""
        with self._lock:
            self.maintain(namespace)
            match = self._tree.match(namespace, tokens)
            if match.matched_len != len(tokens) or not match.path or match.path[-1].end != len(tokens):
                return False
            self._tree.touch(match.path)
            if session is not None:
                self._pins.hold(session, match.path[-1])
            return True

    def maintain(self, namespace: str) -> None:
        """Index the namespace's disk files on first use; drop expired entries (at most every ttl/8 s)."""
        self._placement.index_disk(namespace)
        if self.ttl is None:
            return
        now = time.monotonic()
        if now < self._next_expiry:
            return
        self._next_expiry = now + min(self.ttl / 8, 1.0)
        deadline = now - self.ttl
        while True:
            stale = [n for n in self._tree.iter_nodes() if not n.children and n.lock_ref == 0 and n.used_at < deadline]
            if not stale:
                return
            for node in stale:
                self._placement.drop(node)
            self._requests.expired(len(stale))

    def after_unlock(self, calls: Sequence[Any]) -> None:
        """Work kept out of the lock: file deletions, remote writes and pressure callbacks."""
        if self._placement.disk is not None:
            self._placement.disk.empty_trash()
        if self._placement.remote is not None:
            self._placement.remote.flush()
        for callback, event in calls:
            try:
                callback(event)
            except Exception:  # an app's callback must not break generation
                logger.exception("memory-pressure callback failed")

    def pressure_calls(self) -> list[Any]:
        return self._pressure.check(TIER_NAMES, self._tree.tier_nbytes, self._placement.budgets)


def _never_called(start: int, end: int) -> Segment:
    raise AssertionError("pin_stored() inserts only what is already stored")
