"""TreeStore: the store behind `PrefixCache`: a radix tree of stored states, its tiers, pins and counters.

The one implementation of the contract (`contract.Store`) and of the store's own
verbs that `PrefixCache` exposes to users (stats, budgets, sessions, pins, `lookup`/`insert`,
`save`, `clear`). Where a node lives (device, host, disk, the remote tier) is decided by
`store/placement.py`, over the tiers listed in `storage/tiers.py`. Every tree mutation happens
inside the `StoreLock` (`locking.py`), so several threads may generate through one store; it
runs the blocking work after the lock.

Composed of parts with one job each, built here and handed to each other explicitly. The
contract's verbs are the bound methods of the parts that implement them, exposed as the store's
own, so each signature is written once (there) besides the protocol and a hit makes no call
here: `acquire`, `release`, `insert_sequence` and `relieve_device` are a `prefixes.Prefixes`, over
the tree, placement, lock, pins, counters and upkeep they need;
`namespace` is `keys.weights.Namespaces.current`; `record` is `counters.RequestCounters.record`.

Knows nothing of `generate`: `hooks/` runs the model and calls the contract's verbs.
"""

from __future__ import annotations

import atexit
import functools
import logging
import weakref
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from hf_prefix_cache.keys.prefix_key import PrefixKey
from hf_prefix_cache.keys.weights import Namespaces
from hf_prefix_cache.model.profile import ModelProfile
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.storage.budgets import on_cuda, parse_nbytes
from hf_prefix_cache.storage.codec import Layout
from hf_prefix_cache.storage.encoder_outputs import EncoderOutputs
from hf_prefix_cache.storage.mover import Mover
from hf_prefix_cache.storage.remote import RemoteTier
from hf_prefix_cache.storage.segments import Segment
from hf_prefix_cache.storage.tiers import DEVICE, TIER_NAMES, TierParts, make_tiers
from hf_prefix_cache.store.counters import RequestCounters
from hf_prefix_cache.store.integrity import check_integrity
from hf_prefix_cache.store.locking import StoreLock
from hf_prefix_cache.store.lookup import Lookup, as_token_list, check_manual_media
from hf_prefix_cache.store.observe import PrefillCost, RequestCallback
from hf_prefix_cache.store.options import RemoteOptions, Resolved
from hf_prefix_cache.store.pins import Pins
from hf_prefix_cache.store.placement import Placement
from hf_prefix_cache.store.prefixes import Prefixes
from hf_prefix_cache.store.pressure import PressureCallback, PressureMonitor
from hf_prefix_cache.store.scope import ACTIVE_SCOPES, salt_of
from hf_prefix_cache.store.sessions import Session
from hf_prefix_cache.store.stats import StoreStats, collect_stats
from hf_prefix_cache.store.upkeep import StateDevices, Upkeep
from hf_prefix_cache.tree.policy import make_policy
from hf_prefix_cache.tree.radix import Node, RadixTree

logger = logging.getLogger("hf_prefix_cache")


class TreeStore:
    """A prefix store for one model's states; `PrefixCache` (the user's object) holds one.

    Attributes:
        acquire, release, insert_sequence, relieve_device: `Prefixes`' verbs (`prefixes.py`).
        namespace: `Namespaces.current` (`keys/weights.py`).
        record: `RequestCounters.record` (`counters.py`).
        request_scope: `RequestCounters.scope`: a `scope.RequestScope` of this store.
        new_cache: makes an empty `WorkingCache` for this model.
    """

    def __init__(self, model: Any, profile: ModelProfile, resolved: Resolved) -> None:
        options = resolved.options
        self.model = model
        self.profile = profile  # built once by `PrefixCache`, which hands the same one to the hook
        if any(p.is_meta for p in model.parameters()):
            # The probe notices the weights being loaded (new parameter objects and storage) and refingerprints.
            logger.warning(
                "%s has weights on the meta device: the store fingerprints them once they are loaded; "
                "its default budgets assume a CPU model (give max_bytes / max_host_bytes, or make the "
                "store after loading the weights)",
                type(model).__name__,
            )
        self._build_tiers(resolved)
        self._requests = RequestCounters(self._lock.raw, PrefillCost.of(model, len(self.profile.kv_layers)))
        # A request scope's salt (`scope.py`), keyed by the counters the scope counts into.
        self._namespaces = Namespaces(model, options.salt, ACTIVE_SCOPES, functools.partial(salt_of, self._requests))
        self._upkeep = Upkeep(self._tree, self._placement, self._lock, self._requests, resolved.ttl)
        self._prefixes = Prefixes(
            profile,
            options,
            tree=self._tree,
            placement=self._placement,
            lock=self._lock,
            pins=self._pins,
            requests=self._requests,
            upkeep=self._upkeep,
            devices=self._devices,
        )
        # The contract's hot-path verbs are the hot path's own methods (signatures written once, where they are).
        self.acquire = self._prefixes.acquire
        self.release = self._prefixes.release
        self.insert_sequence = self._prefixes.insert_sequence
        self.relieve_device = self._prefixes.relieve_device
        self.namespace = self._namespaces.current  # see `Namespaces.current`
        self.record = self._requests.record  # see `RequestCounters.record`
        self.request_scope = self._requests.scope  # see `RequestCounters.scope`
        self.new_cache = functools.partial(WorkingCache, profile)  # an empty working cache for this model
        encoder_budget = self.max_bytes // 8 if self.profile.encoder_family is not None else 0
        self.encoder_outputs = EncoderOutputs(
            resolved.max_encoder_bytes if resolved.max_encoder_bytes is not None else encoder_budget
        )
        if self.profile.unsupported is not None:
            logger.warning(
                "%s cannot reuse cached prefixes (%s); generate() through this store runs cold",
                type(model).__name__,
                self.profile.unsupported,
            )
        if resolved.disk_root is not None and options.save_on_exit:
            atexit.register(_save_at_exit, weakref.ref(self))

    def _build_tiers(self, resolved: Resolved) -> None:
        """The tree, its eviction policy, the tiers' placement, pins, pressure monitor and lock."""
        profile = self.profile
        self._policy = make_policy(resolved.options.policy, len(profile.adapters))
        self._tree: RadixTree[Segment] = RadixTree(num_tiers=len(TIER_NAMES), score=self._policy.score)
        cuda = on_cuda(self.model)
        layout = Layout(len(profile.adapters), profile.kv_layers, profile.state_layers, profile.item_layers)
        self._devices = StateDevices(getattr(self.model, "device", None))
        tiers = make_tiers(TierParts(Mover(pin=cuda, use_streams=cuda), self._devices.get, layout, resolved.disk_root))
        self._placement = Placement(
            self._tree, tiers, list(resolved.budgets), self._policy, _make_remote(resolved.remote, layout)
        )
        if resolved.remote is not None and profile.has_state:
            interval, chunk_len = resolved.options.snapshot_interval, resolved.remote.chunk_len
            if interval is None or chunk_len % interval:
                logger.warning(
                    "remote_chunk_len=%d is not a multiple of snapshot_interval=%s: few remote chunks of this "
                    "recurrent model will end at a snapshot, and only those can be reused",
                    chunk_len,
                    interval,
                )
        self._pins = Pins(self._tree)
        self._lock = StoreLock(self._tree, self._placement, PressureMonitor())

    # ------------------------------------------------------------------ the contract (contract.py)
    def has_entries(self, namespace: str) -> bool:
        """Whether the tree holds anything under `namespace` (disk files are not indexed for this)."""
        with self._lock.raw:
            return namespace in self._tree.namespaces()

    # ------------------------------------------------------------------ budgets and stats (PrefixCache's verbs)
    @property
    def max_bytes(self) -> int:
        """The device budget in bytes."""
        return self._placement.budgets[DEVICE]

    @max_bytes.setter
    def max_bytes(self, value: int | str) -> None:
        with self._lock():
            self._placement.budgets[DEVICE] = parse_nbytes(value)
            self._placement.enforce()

    @property
    def ttl(self) -> float | None:
        """Seconds after which an unused entry is dropped (None: never)."""
        return self._upkeep.ttl

    @property
    def budgets(self) -> dict[str, int]:
        """Budget in bytes per tier (0: the tier is off)."""
        return dict(zip(TIER_NAMES, self._placement.budgets, strict=True))

    def stats(self) -> StoreStats:
        """Counters and current size, as an immutable snapshot."""
        with self._lock.raw:
            return collect_stats(self._requests, self._tree, self._placement, self.encoder_outputs)

    def reset_stats(self) -> None:
        """Zero the request counters; stored entries stay."""
        with self._lock.raw:
            self._requests.reset()
            self.encoder_outputs.hits = 0
            self._placement.reset_counters()

    def num_pinned_nodes(self) -> int:
        """Tree nodes pinned now: by requests in flight, named pins and open sessions (none once all are done)."""
        with self._lock.raw:
            return sum(1 for node in self._tree.iter_nodes() if node.lock_ref)

    def nodes(self) -> list[Node[Segment]]:
        """Every node of the tree, parents first (for display; read under the lock)."""
        with self._lock.raw:
            return list(self._tree.iter_nodes())

    def check_integrity(self) -> None:
        """Raise `RuntimeError` when stored bytes, runs, files or snapshots disagree with the tree."""
        with self._lock.raw:
            check_integrity(self._tree, self._placement.counters.num_snapshots, self._placement.mover.pool.owns)

    # ------------------------------------------------------------------ entries
    def clear(self) -> None:
        """Drop every entry on every tier (files included), encoder outputs, pins and sessions."""
        self.encoder_outputs.clear()
        with self._lock():
            self._pins.clear()
            self._placement.clear()

    def save(self) -> int:
        """Move every unpinned entry in memory to the disk tier now; returns how many nodes moved."""
        if self._placement.disk is None:
            raise ValueError("save() needs a disk tier: make the store with disk_dir=...")
        with self._lock():
            self._placement.index_disk(self.namespace())
            return self._placement.save()

    def invalidate(self) -> None:
        """Read the weights again and drop every entry on every tier."""
        self._namespaces.refingerprint()
        self.clear()
        logger.info("invalidated: every stored entry was dropped")

    # ------------------------------------------------------------------ sessions and pins
    def session(self, name: str) -> Session:
        """The open session called `name` (made on first use)."""
        with self._lock.raw:
            return self._pins.session(self, name)

    def end_session(self, session: Session) -> None:
        """Unpin `session`'s entry and close it (what `Session.close` calls)."""
        with self._lock():
            self._pins.end(session)
            self._placement.enforce()

    def stored_len(self, namespace: str, tokens: Sequence[Hashable]) -> int:
        """How many leading `tokens` (or tree symbols) are stored under `namespace` (indexing its disk files first)."""
        with self._lock.raw:
            self._placement.index_disk(namespace)
            return self._tree.match(namespace, tokens).matched_len

    def next_symbols(self, namespace: str, symbols: Sequence[Hashable]) -> list[Hashable]:
        """The symbols stored right after the whole of `symbols` under `namespace` (indexing its disk files first)."""
        with self._lock.raw:
            self._placement.index_disk(namespace)
            return self._tree.next_symbols(namespace, symbols)

    def pin_stored(self, namespace: str, tokens: Sequence[int]) -> bool:
        """Pin the stored prefix `tokens` on the device; False when not all of it is stored."""
        with self._lock.raw:
            if self._tree.match(namespace, tokens).matched_len < len(tokens):
                return False
            path = self._tree.insert(namespace, tokens, _never_called).path
            if self._pins.add(namespace, tokens, path[-1]):
                # A pinned prefix lives on the device; bring back any part that was offloaded.
                self._placement.bring_to_device(path, len(tokens))
            return True

    def unpin(self, token_ids: torch.Tensor | Sequence[int]) -> bool:
        """Undo a pin; returns whether that prefix was pinned."""
        namespace, tokens = self.namespace(), as_token_list(token_ids)
        with self._lock():
            if not self._pins.remove(namespace, tokens):
                return False
            self._placement.enforce()
        return True

    # ------------------------------------------------------------------ callbacks
    def on_pressure(self, callback: PressureCallback, thresholds: Sequence[float] = (0.8, 0.95)) -> None:
        """Call `callback(event)` when a tier's use rises past a fraction of its budget."""
        self._lock.watch(callback, thresholds)

    def on_request(self, callback: RequestCallback) -> None:
        """Call `callback(RequestEvent)` after every `generate` request through the store."""
        self._requests.add_callback(callback)

    # ------------------------------------------------------------------ custom forward loops
    def lookup(self, input_ids: torch.Tensor | Sequence[int]) -> Lookup:
        """Restore the longest usable stored prefix of `input_ids` into a fresh working cache, pinned."""
        if self.profile.unsupported is not None:
            raise ValueError(f"{type(self.model).__name__} cannot reuse cached prefixes: {self.profile.unsupported}")
        tokens = as_token_list(input_ids)
        if not tokens:
            raise ValueError("lookup() needs at least one token id")
        check_manual_media(self.profile, tokens)
        cache = self.new_cache()
        lease = self.acquire(PrefixKey(self.namespace(), tokens), cache)
        return Lookup(self, lease, cache)

    def insert(self, token_ids: torch.Tensor | Sequence[int], cache: WorkingCache) -> int:
        """Store `cache`, which holds exactly the states of `token_ids`; returns new tokens stored."""
        if not isinstance(cache, WorkingCache) or cache.profile is not self.profile:
            raise ValueError("insert() takes a cache made by this store's lookup()")
        tokens = as_token_list(token_ids)
        check_manual_media(self.profile, tokens)
        kv_len = cache.kv_length()
        if kv_len is not None and kv_len != len(tokens):
            raise ValueError(f"the cache holds {kv_len} positions but {len(tokens)} token ids were given")
        return self.insert_sequence(PrefixKey(self.namespace(), tokens), cache).new_tokens


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


def _never_called(start: int, end: int) -> Segment:
    raise AssertionError("pin_stored() inserts only what is already stored")
