"""TreeStore: the store behind `PrefixCache`: a radix tree of stored states, its tiers and its counters.

Implements the contract of `contract.py` (`acquire`, `release`, `insert_sequence`, counting)
and the store's own API (stats, budgets, sessions, pins, `lookup`/`insert`, `save`, `clear`).
Where a node lives (device, host, disk, the remote tier) is decided by `storage/placement.py`.
Every tree mutation happens under one lock, so several threads may generate through one store;
work that may block (file deletions, remote writes, callbacks) runs after the lock is let go.

Knows nothing of `generate`: `integration/` runs the model and calls the contract's verbs.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from hf_prefix_cache._compat import check_transformers
from hf_prefix_cache.model.profile import ModelProfile, profile_model
from hf_prefix_cache.model.states import ItemState, Snapshot, all_finite, state_tensors
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.multimodal.media import clamp_below_spans
from hf_prefix_cache.storage.budgets import on_cuda, parse_nbytes
from hf_prefix_cache.storage.codec import CorruptFileError, Layout
from hf_prefix_cache.storage.disk import DiskTier
from hf_prefix_cache.storage.encoder_outputs import EncoderOutputs
from hf_prefix_cache.storage.placement import Placement
from hf_prefix_cache.storage.remote import RemoteTier
from hf_prefix_cache.storage.segments import Segment, best_snapshot, join_kv, kv_pieces, stored_item_states
from hf_prefix_cache.storage.tiers import DEVICE, DISK, HOST, TIER_NAMES, Mover
from hf_prefix_cache.store.contract import InsertOutcome, Lease
from hf_prefix_cache.store.counters import RequestCounters
from hf_prefix_cache.store.integrity import check_integrity
from hf_prefix_cache.store.lookup import Lookup, as_token_list, check_manual_media
from hf_prefix_cache.store.namespaces import Namespaces
from hf_prefix_cache.store.observe import PrefillCost, RequestCallback
from hf_prefix_cache.store.options import RemoteOptions, StoreOptions
from hf_prefix_cache.store.pins import Pins
from hf_prefix_cache.store.pressure import PressureCallback, PressureMonitor
from hf_prefix_cache.store.sessions import Session
from hf_prefix_cache.store.stats import CacheStats
from hf_prefix_cache.tree.policy import make_policy
from hf_prefix_cache.tree.radix import Node, RadixTree

logger = logging.getLogger("hf_prefix_cache")

# Reasons an insert stores nothing, counted under `fallbacks`.
ENTRY_BELOW_MIN_STORE_LEN = "entry_below_min_store_len"
NON_FINITE_STATES = "non_finite_states"
ENTRY_OVER_BUDGET = "entry_over_budget"


class _Pin:
    """A lease's hold on the deepest node of its matched path (None: nothing matched)."""

    __slots__ = ("node", "released")

    def __init__(self, node: Node[Segment] | None) -> None:
        self.node = node
        self.released = False


class TreeStore:
    """A prefix store for one model's states; `PrefixCache` (the user's class) adds `generate` to it."""

    def __init__(self, model: Any, options: StoreOptions, encoder_family: str | None = None) -> None:
        check_transformers()
        self.model = model
        self.profile: ModelProfile = profile_model(model, options.sliding_window_mode, encoder_family)
        self.snapshot_interval = options.snapshot_interval
        self.salt = options.salt
        self.ttl = options.ttl
        self.min_store_len = options.min_store_len
        self.max_entries = options.max_entries
        self.remote_write = options.remote.write if options.remote is not None else "back"
        self._namespaces = Namespaces(model, options.salt)
        if any(p.is_meta for p in model.parameters()):
            # The probe notices the weights being loaded (new parameter objects and storage) and refingerprints.
            logger.warning(
                "%s has weights on the meta device: the store fingerprints them once they are loaded; "
                "its default budgets assume a CPU model (give max_bytes / max_host_bytes, or make the "
                "store after loading the weights)",
                type(model).__name__,
            )
        self._policy = make_policy(options.policy, len(self.profile.adapters))
        self._tree: RadixTree[Segment] = RadixTree(num_tiers=len(TIER_NAMES), score=self._policy.score)
        cuda = on_cuda(model)
        layout = Layout(
            len(self.profile.adapters), self.profile.kv_layers, self.profile.state_layers, self.profile.item_layers
        )
        self._state_devices: dict[int, torch.device] = {}
        self._placement = Placement(
            self._tree,
            list(options.budgets),
            Mover(pin=cuda, use_streams=cuda),
            DiskTier(options.disk_root, layout) if options.disk_root is not None else None,
            self._policy,
            self._state_device,
            _make_remote(options.remote, layout),
        )
        if options.remote is not None and self.profile.has_state:
            interval, chunk_len = options.snapshot_interval, options.remote.chunk_len
            if interval is None or chunk_len % interval:
                logger.warning(
                    "remote_chunk_len=%d is not a multiple of snapshot_interval=%s: few remote chunks of this "
                    "recurrent model will end at a snapshot, and only those can be reused",
                    chunk_len,
                    interval,
                )
        self._lock = threading.RLock()
        self._requests = RequestCounters(self._lock, PrefillCost.of(model, len(self.profile.kv_layers)))
        self._pins = Pins(self._tree)
        self._sessions = self._pins.sessions
        self._pressure = PressureMonitor()
        self._next_expiry = 0.0
        encoder_budget = self.max_bytes // 8 if self.profile.encoder_family is not None else 0
        self.encoder_outputs = EncoderOutputs(
            options.max_encoder_bytes if options.max_encoder_bytes is not None else encoder_budget
        )
        if self.profile.unsupported is not None:
            logger.warning(
                "%s cannot reuse cached prefixes (%s); generate() through this store runs cold",
                type(model).__name__,
                self.profile.unsupported,
            )
        if options.disk_root is not None and options.save_on_exit:
            atexit.register(_save_at_exit, weakref.ref(self))

    # ------------------------------------------------------------------ budgets and stats
    @property
    def max_bytes(self) -> int:
        """The device budget in bytes (settable; the store shrinks to it on the next insert)."""
        return self._placement.budgets[DEVICE]

    @max_bytes.setter
    def max_bytes(self, value: int | str) -> None:
        with self._lock:
            self._placement.budgets[DEVICE] = parse_nbytes(value)
            self._placement.enforce()
        self._after_unlock(())

    @property
    def budgets(self) -> dict[str, int]:
        """Budget in bytes per tier (0: the tier is off)."""
        return dict(zip(TIER_NAMES, self._placement.budgets, strict=True))

    def stats(self) -> CacheStats:
        """Counters and current size, as an immutable snapshot."""
        with self._lock:
            c = self._requests.counts
            p = self._placement.counters
            tier_nbytes = self._tree.tier_nbytes
            return CacheStats(
                requests=c.requests,
                hit_requests=c.hit_requests,
                prompt_tokens=c.prompt_tokens,
                hit_tokens=c.hit_tokens,
                computed_tokens=c.computed_tokens,
                entries=self._tree.num_leaves,
                nodes=self._tree.num_nodes,
                nbytes=self._tree.total_nbytes,
                max_bytes=self.max_bytes,
                device_nbytes=tier_nbytes[DEVICE],
                host_nbytes=tier_nbytes[HOST],
                disk_nbytes=tier_nbytes[DISK],
                max_host_bytes=self._placement.budgets[HOST],
                max_disk_bytes=self._placement.budgets[DISK],
                snapshots=p.num_snapshots,
                evictions=p.evictions,
                evicted_bytes=p.evicted_bytes,
                offloads=p.offloads,
                reloads=p.reloads,
                expired=c.expired,
                skipped_files=p.skipped_files,
                fallbacks=dict(c.fallbacks),
                encoder_entries=self.encoder_outputs.num_entries,
                encoder_nbytes=self.encoder_outputs.nbytes,
                max_encoder_bytes=self.encoder_outputs.max_bytes,
                encoder_hits=self.encoder_outputs.hits,
                hit_tokens_by_modality=dict(c.hit_by_modality),
                saved_prefill_flops=c.saved_prefill_flops,
                **self._remote_stats(),
            )

    def reset_stats(self) -> None:
        """Zero the request counters; stored entries stay."""
        with self._lock:
            self._requests.reset()
            self.encoder_outputs.hits = 0
            self._placement.reset_counters()

    def check_integrity(self) -> None:
        """Raise `RuntimeError` when stored bytes, runs, files or snapshots disagree with the tree."""
        with self._lock:
            check_integrity(self._tree, self._placement.counters.num_snapshots)

    # ------------------------------------------------------------------ entries
    def clear(self) -> None:
        """Drop every stored entry, on every tier (disk files included), stored encoder outputs, pins and sessions."""
        self.encoder_outputs.clear()
        with self._lock:
            self._pins.clear()
            self._placement.clear()
        self._after_unlock(())

    def save(self) -> int:
        """Move every unpinned entry in memory to the disk tier now; returns how many nodes moved.

        Entries on disk are found again by a new process with the same model and `disk_dir`.
        With `save_on_exit` (the default) this runs when the process exits.

        Raises:
            ValueError: when the store has no `disk_dir`.
        """
        if self._placement.disk is None:
            raise ValueError("save() needs a disk tier: make the store with disk_dir=...")
        with self._lock:
            self._placement.index_disk(self.namespace())
            moved = self._placement.save()
        self._after_unlock(())
        return moved

    def namespace(self) -> str:
        """The model's current namespace (recomputed when its dtype, adapters or weights change).

        A `WeightsProbe` check runs on every call (a few microseconds per parameter); see
        `keys.weights.WeightsProbe` for what it notices and `invalidate` for what it cannot.
        """
        return self._namespaces.current()

    def invalidate(self) -> None:
        """Forget everything stored, after changing the weights in a way the store cannot see.

        The store notices replaced parameters, in-place updates (`load_state_dict`, optimizer
        steps), switched adapters, and `.data` edits that touch the elements it samples. An
        in-place `.data` edit of only a few elements (one embedding row) can escape it: call
        this after one. Reads the weights again and drops every entry on every tier.

        Example:
            >>> _ = model.generate(ids, past_key_values=store, max_new_tokens=1)
            >>> model.model.embed_tokens.weight.data[7] += 1  # one row: the sampled elements may miss it
            >>> store.invalidate()
            >>> store.stats().entries
            0
        """
        self._namespaces.refingerprint()
        self.clear()
        logger.info("invalidated: every stored entry was dropped")

    def has_entries(self, namespace: str) -> bool:
        """Whether the tree holds anything under `namespace` (disk files are not indexed for this)."""
        with self._lock:
            return namespace in self._tree.namespaces()

    def stored_len(self, namespace: str, tokens: Sequence[int]) -> int:
        """How many leading `tokens` are stored under `namespace` (indexing its disk files first)."""
        with self._lock:
            self._placement.index_disk(namespace)
            return self._tree.match(namespace, tokens).matched_len

    # ------------------------------------------------------------------ sessions and pins
    def session(self, name: str) -> Session:
        """The open session called `name` (made on first use): pass it as `past_key_values`.

        The conversation's latest entry stays pinned until `session.close()`.
        """
        with self._lock:
            return self._pins.session(self, name)

    def end_session(self, session: Session) -> None:
        """Unpin `session`'s entry and close it (what `Session.close` calls)."""
        with self._lock:
            self._pins.end(session)
            self._placement.enforce()
        self._after_unlock(())

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

    def unpin(self, token_ids: torch.Tensor | Sequence[int]) -> bool:
        """Undo `pin`; returns whether that prefix was pinned."""
        namespace, tokens = self.namespace(), as_token_list(token_ids)
        with self._lock:
            if not self._pins.remove(namespace, tokens):
                return False
            self._placement.enforce()
        self._after_unlock(())
        return True

    # ------------------------------------------------------------------ callbacks
    def on_pressure(self, callback: PressureCallback, thresholds: Sequence[float] = (0.8, 0.95)) -> None:
        """Call `callback(event)` when a tier's use rises past a fraction of its budget.

        Each threshold fires once per crossing (again only after use fell below it). The
        callback runs outside the store's lock, in the thread that stored the entry.
        """
        with self._lock:
            self._pressure.add(callback, thresholds)

    def on_request(self, callback: RequestCallback) -> None:
        """Call `callback(RequestEvent)` after every `generate` request through the store.

        The event says what the request reused (per modality), the prefill it spared and why it
        ran cold, if it did; the callback runs outside the store's lock, and an exception in it
        is logged, never raised into `generate`. `hf_prefix_cache.frontends.prometheus` builds on
        the stats instead, for scraping.

        Example:
            >>> events = []
            >>> store.on_request(events.append)
            >>> for _ in range(2):
            ...     _ = model.generate(ids, past_key_values=store, max_new_tokens=1)
            >>> events[-1].hit_tokens_by_modality
            {'text': 35}
        """
        self._requests.add_callback(callback)

    # ------------------------------------------------------------------ custom forward loops
    def lookup(self, input_ids: torch.Tensor | Sequence[int]) -> Lookup:
        """Restore the longest usable stored prefix of `input_ids` into a fresh working cache.

        For custom forward loops: feed the model `input_ids[:, lookup.cached_len:]` with
        `past_key_values=lookup.cache`, then call `insert` with the ids the cache now covers.

        Example:
            >>> with store.lookup(ids) as hit:
            ...     out = model(ids[:, hit.cached_len:], past_key_values=hit.cache, use_cache=True)
            >>> store.insert(ids, hit.cache)  # new tokens stored
            36

        Raises:
            ValueError: when the model cannot be served (reason in the message) or the ids are not one sequence.
        """
        if self.profile.unsupported is not None:
            raise ValueError(f"{type(self.model).__name__} cannot reuse cached prefixes: {self.profile.unsupported}")
        tokens = as_token_list(input_ids)
        if not tokens:
            raise ValueError("lookup() needs at least one token id")
        check_manual_media(self.profile, tokens)
        cache = self.new_cache()
        lease = self.acquire(self.namespace(), tokens, cache)
        return Lookup(self, lease, cache)

    def insert(self, token_ids: torch.Tensor | Sequence[int], cache: WorkingCache) -> int:
        """Store `cache`, which must hold exactly the states of `token_ids`; returns new tokens stored.

        Raises:
            ValueError: when the cache's length disagrees with the ids, or it is not a working cache of this store.
        """
        if not isinstance(cache, WorkingCache) or cache.profile is not self.profile:
            raise ValueError("insert() takes a cache made by this store's lookup() or new_cache()")
        tokens = as_token_list(token_ids)
        check_manual_media(self.profile, tokens)
        kv_len = cache.kv_length()
        if kv_len is not None and kv_len != len(tokens):
            raise ValueError(f"the cache holds {kv_len} positions but {len(tokens)} token ids were given")
        return self.insert_sequence(self.namespace(), tokens, cache).new_tokens

    def new_cache(self) -> WorkingCache:
        """An empty working cache for this model."""
        return WorkingCache(self.profile)

    # ------------------------------------------------------------------ the contract (contract.py)
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
        """Match `symbols`, pin the matched path, restore the usable prefix into `into`; see `contract.Store`.

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
                    self._maintain(namespace)
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
                    calls = self._pressure_calls()
                break
            self._after_unlock(calls)
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

    def insert_sequence(
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
            return self._skip(ENTRY_BELOW_MIN_STORE_LEN)
        assert row is None or not self.profile.has_state, "batched inserts are for attention-only models"
        if not self.profile.has_state and not items and self._touch_if_stored(namespace, tokens, session):
            return InsertOutcome(0)  # an exact repeat: nothing new to capture
        run = cache.capture_run(length, row) if self.profile.has_kv else None
        all_snapshots = list(snapshots)
        if self.profile.has_state:
            all_snapshots.append(cache.snapshot(length))
            self._remember_state_devices(all_snapshots[-1])
            all_snapshots = cache.merge_windows(all_snapshots)  # window mode: touching windows held once
        if items:
            self._remember_state_devices(items[0])
        fresh = run.slice(min(computed_from, length), length) if run is not None else ([], [])
        if not all_finite([*fresh[0], *fresh[1], *state_tensors(all_snapshots), *state_tensors(items)]):
            self._requests.log_once(
                NON_FINITE_STATES,
                "not storing %d tokens: their states hold NaN or infinity (check the inputs, e.g. pixel values)",
                length,
            )
            return self._skip(NON_FINITE_STATES)
        nbytes_per_token = run.nbytes_per_token if run is not None else 0
        with self._lock:
            self._maintain(namespace)
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
                return self._skip(ENTRY_OVER_BUDGET)
            result = self._tree.insert(namespace, tokens, lambda a, b: Segment(run, a, b, nbytes_per_token))
            if run is not None and result.new_node is not None:
                run.num_refs += 1
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
            calls = self._pressure_calls()
        self._after_unlock(calls)
        if length > result.matched_len:
            logger.info("prefix cache: stored %d new tokens (%d in all)", length - result.matched_len, length)
        return InsertOutcome(length - result.matched_len)

    def relieve_device(self) -> None:
        """Move every unpinned entry off the device (after an out-of-memory error)."""
        with self._lock:
            self._placement.free_device()
        self._after_unlock(())
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def count_request(
        self, prompt_len: int, restore_len: int, num_rows: int = 1, symbols: Sequence[Hashable] | None = None
    ) -> None:
        """Count a served request; `symbols` (the prompt's tree symbols) split its hits by modality."""
        self._requests.served(prompt_len, restore_len, num_rows, symbols)

    def count_fallback(self, reason: str, prompt_len: int, log: bool = True) -> None:
        """Count a request run cold for `reason`; with `log`, also log it (see `log_fallback`)."""
        self._requests.cold(reason, prompt_len)
        if log:
            self.log_fallback(reason)

    def log_fallback(self, reason: str) -> None:
        """Log a cold run: a WARNING the first time a reason occurs in this store, DEBUG after."""
        self._requests.log_once(reason, "prefix cache skipped, running cold: %s", reason)

    def count_reduced_reuse(self, reason: str) -> None:
        """Count `reason` in `fallbacks` for a request that was served (and stored) but reused less."""
        self._requests.event(reason)

    # ------------------------------------------------------------------ helpers
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
            self._maintain(namespace)
            have = self._tree.match(namespace, tokens).matched_len
        if have >= last * remote.chunk_len:
            return
        hit = remote.fetch(namespace, tokens, have // remote.chunk_len, last, need_snapshot=self.profile.has_state)
        if hit.error is not None:
            self.count_reduced_reuse(hit.error)
        if hit.segment is None or hit.segment.end <= have:
            return
        with self._lock:
            self._placement.adopt(namespace, tokens, hit.segment)
            calls = self._pressure_calls()
        self._after_unlock(calls)

    def _remote_stats(self) -> dict[str, int]:
        remote = self._placement.remote
        if remote is None:
            return {}
        c = remote.counters
        return {
            "remote_hits": c.hits,
            "remote_hit_tokens": c.hit_tokens,
            "remote_bytes_read": c.bytes_read,
            "remote_bytes_written": c.bytes_written,
            "remote_errors": c.errors,
            "remote_skipped_writes": c.skipped_writes,
        }

    def _touch_if_stored(self, namespace: str, tokens: Sequence[Any], session: Session | None) -> bool:
        """If all of `tokens` is stored already, mark it used (and held by `session`) and say so."""
        with self._lock:
            self._maintain(namespace)
            match = self._tree.match(namespace, tokens)
            if match.matched_len != len(tokens) or not match.path or match.path[-1].end != len(tokens):
                return False
            self._tree.touch(match.path)
            if session is not None:
                self._pins.hold(session, match.path[-1])
            return True

    def _maintain(self, namespace: str) -> None:
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

    def _remember_state_devices(self, snap: Snapshot) -> None:
        if len(self._state_devices) == len(snap.states):
            return
        for layer, state in snap.states.items():
            first = next((t for per in state.tensors.values() for t in per.values() if t is not None), None)
            if first is not None:
                self._state_devices[layer] = first.device

    def _state_device(self, layer: int) -> torch.device | None:
        return self._state_devices.get(layer, getattr(self.model, "device", None))

    def _after_unlock(self, calls: Sequence[Any]) -> None:
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

    def _pressure_calls(self) -> list[Any]:
        return self._pressure.check(TIER_NAMES, self._tree.tier_nbytes, self._placement.budgets)


def _save_at_exit(ref: weakref.ref[TreeStore]) -> None:
    store = ref()
    if store is not None:
        try:
            store.save()
        except Exception:  # at exit, a failed save only loses what was in memory anyway
            logger.exception("could not save the prefix cache to disk at exit")


def _never_called(start: int, end: int) -> Segment:
    raise AssertionError("pin_stored() inserts only what is already stored")


def _make_remote(options: RemoteOptions | None, layout: Layout) -> RemoteTier | None:
    if options is None:
        return None
    return RemoteTier(
        options.url,
        layout,
        chunk_len=options.chunk_len,
        ttl=options.ttl,
        timeout=options.timeout,
        max_write_bytes=options.max_write_bytes,
    )
