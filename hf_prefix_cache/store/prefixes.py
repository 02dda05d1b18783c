"""Prefixes: a store's leases, `acquire` and `release`, as named steps (the other hot verb is `new_entries.py`).

`acquire`: fetch from the remote tier on a local miss, then (under the lock) match, pin the
matched path, bring it to the device and plan what to restore, then (outside it) restore into
the caller's working cache. `release` lets the pin go.

Each verb holds the store's lock once, holding `StoreLock.raw` directly and making the lock's two
follow-up steps itself only when the store is not `quiet` (see `locking.py`). Steps with nothing
to do are not called: upkeep only where there is a disk tier or a ttl, the remote fetch only with
a remote tier, bringing a path back only when a node of it is off the device (`on_device`).

Composed, not inherited: `TreeStore` builds the tree, its placement, lock, pins, counters and
upkeep, hands them to `Prefixes` and `NewEntries` in its constructor, and exposes their verbs as
its own (they are the contract's, `contract.Store`: their signatures are written here, in
`new_entries.py` and in the protocol only).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.keys.prefix_key import PrefixKey
from hf_prefix_cache.model.landing import Landing, land_all
from hf_prefix_cache.model.profile import ModelProfile
from hf_prefix_cache.model.states import ItemState, Snapshot
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
from hf_prefix_cache.storage.tiers import DEVICE
from hf_prefix_cache.store.contract import Lease
from hf_prefix_cache.store.locking import StoreLock
from hf_prefix_cache.store.placement import Placement
from hf_prefix_cache.store.upkeep import Upkeep
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
    """A store's leases over the parts it is handed: `acquire`, `release` (and `relieve_device`).

    Args:
        profile: what the model's layers can do (the one profile the store and the hook share).
        tree: the store's radix tree of `Segment`s.
        placement: which tier each node sits on; the only caller of the tree's eviction verbs.
        lock: the store's one lock owner (`locking.py`).
        upkeep: disk indexing, TTL expiry and remote fetches around a match.
    """

    def __init__(
        self,
        profile: ModelProfile,
        *,
        tree: RadixTree[Segment],
        placement: Placement,
        lock: StoreLock,
        upkeep: Upkeep,
    ) -> None:
        self.profile = profile
        self._tree = tree
        self._placement = placement
        self._lock = lock
        self._upkeep = upkeep

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


def on_device(nodes: Sequence[Node[Segment]]) -> list[Segment] | None:
    """The segments of `nodes` when every one is on the device (nothing to bring back), else None."""
    out: list[Segment] = []
    for node in nodes:
        if node.tier != DEVICE or node.value is None:
            return None
        out.append(node.value)
    return out
