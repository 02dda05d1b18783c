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
import weakref
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from hf_prefix_cache._compat import check_transformers
from hf_prefix_cache.keys.namespace import fingerprint
from hf_prefix_cache.model.profile import ModelProfile, profile_model
from hf_prefix_cache.model.states import ItemState, Snapshot
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.storage.budgets import on_cuda, parse_nbytes
from hf_prefix_cache.storage.codec import Layout
from hf_prefix_cache.storage.disk import DiskTier
from hf_prefix_cache.storage.encoder_outputs import EncoderOutputs
from hf_prefix_cache.storage.placement import Placement
from hf_prefix_cache.storage.remote import RemoteTier
from hf_prefix_cache.storage.segments import Segment
from hf_prefix_cache.storage.tiers import DEVICE, TIER_NAMES, Mover
from hf_prefix_cache.store.contract import InsertOutcome, Lease
from hf_prefix_cache.store.counters import RequestCounters
from hf_prefix_cache.store.integrity import check_integrity
from hf_prefix_cache.store.lookup import Lookup, as_token_list, check_manual_media
from hf_prefix_cache.store.namespaces import Namespaces
from hf_prefix_cache.store.observe import PrefillCost, RequestCallback
from hf_prefix_cache.store.options import RemoteOptions, StoreOptions
from hf_prefix_cache.store.pins import Pins
from hf_prefix_cache.store.prefixes import Prefixes, StateDevices
from hf_prefix_cache.store.pressure import PressureCallback, PressureMonitor
from hf_prefix_cache.store.scope import current as current_scope
from hf_prefix_cache.store.sessions import Session
from hf_prefix_cache.store.stats import CacheStats, collect_stats
from hf_prefix_cache.tree.policy import make_policy
from hf_prefix_cache.tree.radix import RadixTree

logger = logging.getLogger("hf_prefix_cache")


class TreeStore:
    """A prefix store for one model's states; `PrefixCache` (the user's class) adds `generate` to it."""

    def __init__(self, model: Any, options: StoreOptions, encoder_family: str | None = None) -> None:
        check_transformers()
        self.model = model
        self.profile: ModelProfile = profile_model(model, options.sliding_window_mode, encoder_family)
        self.snapshot_interval = options.snapshot_interval
        self.prompt_snapshot = options.prompt_snapshot
        self.salt = options.salt
        # Whether the hook serves `generate` calls that pass no cache (PrefixCache(attach="all")).
        self.serves_uncached = False
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
        devices = StateDevices(getattr(model, "device", None))
        self._placement = Placement(
            self._tree,
            list(options.budgets),
            Mover(pin=cuda, use_streams=cuda),
            DiskTier(options.disk_root, layout) if options.disk_root is not None else None,
            self._policy,
            devices.get,
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
        self._prefixes = Prefixes(
            self.profile,
            self._tree,
            self._placement,
            devices,
            self._lock,
            self._pins,
            self._requests,
            self._pressure,
            ttl=options.ttl,
            min_store_len=options.min_store_len,
            max_entries=options.max_entries,
            remote_write=options.remote.write if options.remote is not None else "back",
        )
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
        self._prefixes.after_unlock(())

    @property
    def ttl(self) -> float | None:
        """Seconds after which an unused entry is dropped (None: never)."""
        return self._prefixes.ttl

    @property
    def min_store_len(self) -> int:
        """Sequences shorter than this many tokens are not stored."""
        return self._prefixes.min_store_len

    @property
    def max_entries(self) -> int | None:
        """Most entries kept over all tiers (None: no limit)."""
        return self._prefixes.max_entries

    @property
    def remote_write(self) -> str:
        """When entries are written to the remote tier: ``"back"`` or ``"through"``."""
        return self._prefixes.remote_write

    @property
    def budgets(self) -> dict[str, int]:
        """Budget in bytes per tier (0: the tier is off)."""
        return dict(zip(TIER_NAMES, self._placement.budgets, strict=True))

    def stats(self) -> CacheStats:
        """Counters and current size, as an immutable snapshot."""
        with self._lock:
            return collect_stats(self._requests.counts, self._tree, self._placement, self.encoder_outputs)

    def reset_stats(self) -> None:
        """Zero the request counters; stored entries stay."""
        with self._lock:
            self._requests.reset()
            self.encoder_outputs.hits = 0
            self._placement.reset_counters()

    def num_pinned_nodes(self) -> int:
        """Tree nodes pinned now: by requests in flight, named pins and open sessions (none once all are done)."""
        with self._lock:
            return sum(1 for node in self._tree.iter_nodes() if node.lock_ref)

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
        self._prefixes.after_unlock(())

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
        self._prefixes.after_unlock(())
        return moved

    def namespace(self) -> str:
        """The model's current namespace (recomputed when its dtype, adapters or weights change).

        A `WeightsProbe` check runs on every call (a few microseconds per parameter); see
        `keys.weights.WeightsProbe` for what it notices and `invalidate` for what it cannot.
        Inside a request scope with a salt (`store/scope.py`), a namespace of that salt's own.
        """
        namespace = self._namespaces.current()
        scope = current_scope()
        if scope is not None and scope.salt is not None:
            namespace = fingerprint([namespace, "request salt", scope.salt])
        return namespace

    def invalidate(self) -> None:
        """Forget everything stored, after changing the weights in a way the store cannot see.

        The store notices replaced parameters, in-place updates (`load_state_dict`, optimizer
        steps), switched adapters, and `.data` edits that touch the elements it samples. An
        in-place `.data` edit of only a few elements (one embedding row) can escape it: call
        this after one. Reads the weights again and drops every entry on every tier.

        Example:
            >>> _ = model.generate(ids, cache=store, max_new_tokens=1)
            >>> model.model.embed_tokens.weight.data[7] += 1  # one row: the sampled elements may miss it
            >>> store.invalidate()
            >>> store.stats().entries
            0
        """
        self._namespaces.refingerprint()
        self.clear()
        logger.info("invalidated: every stored entry was dropped")

    # ------------------------------------------------------------------ sessions and pins
    def session(self, name: str) -> Session:
        """The open session called `name` (made on first use): pass it as `cache` (or `past_key_values`).

        The conversation's latest entry stays pinned until `session.close()`.
        """
        with self._lock:
            return self._pins.session(self, name)

    def end_session(self, session: Session) -> None:
        """Unpin `session`'s entry and close it (what `Session.close` calls)."""
        with self._lock:
            self._pins.end(session)
            self._placement.enforce()
        self._prefixes.after_unlock(())

    def pin_stored(self, namespace: str, tokens: Sequence[int]) -> bool:
        """Pin the stored prefix `tokens` on the device; False when not all of it is stored."""
        return self._prefixes.pin_stored(namespace, tokens)

    def unpin(self, token_ids: torch.Tensor | Sequence[int]) -> bool:
        """Undo `pin`; returns whether that prefix was pinned."""
        namespace, tokens = self.namespace(), as_token_list(token_ids)
        with self._lock:
            if not self._pins.remove(namespace, tokens):
                return False
            self._placement.enforce()
        self._prefixes.after_unlock(())
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
            ...     _ = model.generate(ids, cache=store, max_new_tokens=1)
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
        """Match `symbols`, pin the entry, restore the usable prefix into `into` (see `contract.Store.acquire`).

        A request scope active here (`store/scope.py`) is told the restored length.
        """
        lease = self._prefixes.acquire(
            namespace, symbols, into, limit=limit, spans=spans, item_spans=item_spans, batch_size=batch_size
        )
        scope = current_scope()
        if scope is not None:
            scope.record(lease.cached_len)
        return lease

    def release(self, lease: Lease) -> None:
        """Unpin the lease's entry; a second call does nothing."""
        self._prefixes.release(lease)

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
        """Store `cache`'s states of all of `symbols` (see `contract.Store.insert_sequence` and `Prefixes.insert`)."""
        return self._prefixes.insert(
            namespace, symbols, cache, snapshots, row=row, session=session, items=items, computed_from=computed_from
        )

    def relieve_device(self) -> None:
        """Move every unpinned entry off the device (after an out-of-memory error)."""
        self._prefixes.relieve_device()

    def has_entries(self, namespace: str) -> bool:
        """Whether the tree holds anything under `namespace` (disk files are not indexed for this)."""
        return self._prefixes.has_entries(namespace)

    def stored_len(self, namespace: str, tokens: Sequence[int]) -> int:
        """How many leading `tokens` are stored under `namespace` (indexing its disk files first)."""
        return self._prefixes.stored_len(namespace, tokens)

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


def _save_at_exit(ref: weakref.ref[TreeStore]) -> None:
    store = ref()
    if store is not None:
        try:
            store.save()
        except Exception:  # at exit, a failed save only loses what was in memory anyway
            logger.exception("could not save the prefix cache to disk at exit")


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
