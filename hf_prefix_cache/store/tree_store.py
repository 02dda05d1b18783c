"""PrefixCache: the store users hand to `generate`, and its low-level `lookup`/`insert` API.

Owns the radix tree of token ids, the key/value runs and state snapshots its nodes point to,
the budgets, pins, sessions and counters. Where a node lives (device, host, disk) is decided
by `placement.py`. Every tree mutation happens under one lock, so several threads may
generate through one store. Running the model is not this module's job: the generation hook
(`hook.py`) does that and calls `acquire`/`release`/`insert_sequence` here.
"""

from __future__ import annotations

import atexit
import logging
import numbers
import os
import threading
import time
import weakref
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from hf_prefix_cache._compat import check_transformers
from hf_prefix_cache.keys.namespace import model_namespace
from hf_prefix_cache.keys.weights import WeightsProbe, weights_fingerprint
from hf_prefix_cache.model.layers import SLIDING_WINDOW_MODES
from hf_prefix_cache.model.profile import ModelProfile, profile_model
from hf_prefix_cache.model.states import Run, Snapshot, all_finite, state_tensors
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.multimodal.media import clamp_below_spans
from hf_prefix_cache.storage.budgets import (
    default_disk_bytes,
    default_host_bytes,
    default_max_bytes,
    on_cuda,
    parse_nbytes,
    parse_seconds,
)
from hf_prefix_cache.storage.disk import CorruptFileError, DiskTier, Layout, usable_folder
from hf_prefix_cache.storage.encoder_outputs import EncoderOutputs
from hf_prefix_cache.storage.placement import Placement
from hf_prefix_cache.storage.remote import RemoteCounters, RemoteTier
from hf_prefix_cache.storage.segments import Segment, best_snapshot, item_states, join_kv, kv_pieces
from hf_prefix_cache.storage.tiers import DEVICE, DISK, HOST, TIER_NAMES, Mover, snapshot_to_host
from hf_prefix_cache.store.observe import PrefillCost, RequestCallback, RequestEvent, hit_tokens_by_modality
from hf_prefix_cache.store.pressure import PressureCallback, PressureMonitor
from hf_prefix_cache.store.sessions import Session
from hf_prefix_cache.store.stats import CacheStats
from hf_prefix_cache.tree.policy import make_policy
from hf_prefix_cache.tree.radix import Node, RadixTree

if TYPE_CHECKING:
    from types import TracebackType

    from hf_prefix_cache.integration.generate_hook import GenerateHook

logger = logging.getLogger("hf_prefix_cache")

# Cache methods transformers calls; reaching one means the store was passed where a Cache was expected.
_CACHE_API = frozenset(
    {
        "get_seq_length",
        "update",
        "get_mask_sizes",
        "layers",
        "crop",
        "reorder_cache",
        "update_conv_state",
        "update_recurrent_state",
        "has_previous_state",
        "get_max_length",
        "is_initialized",
        "get_query_offset",
        "is_compileable",
        "is_sliding",
        "early_initialization",
        "batch_size",
    }
)


class _NotAWorkingCacheError(AttributeError):
    """A store was used where transformers expected a Cache."""


@dataclass(slots=True)
class Plan:
    """What one request takes from the store: the first `restore_len` tokens, pinned until `release`.

    `items` are the states of the media items inside the restored prefix, in prompt order.
    """

    namespace: str
    restore_len: int
    matched_len: int
    keys: list[torch.Tensor | None] | None
    values: list[torch.Tensor | None] | None
    snapshot: Snapshot | None
    path: tuple[Node[Segment], ...]
    released: bool = False
    items: list[Snapshot] = field(default_factory=list)


@dataclass(slots=True)
class _Counters:
    requests: int = 0
    hit_requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    computed_tokens: int = 0
    expired: int = 0
    fallbacks: Counter[str] = field(default_factory=Counter)
    hit_by_modality: Counter[str] = field(default_factory=Counter)
    saved_prefill_flops: int = 0


class Lookup:
    """A working cache restored from the store, pinned while the `with` block runs.

    Attributes:
        cache: a `transformers.Cache` holding the first `cached_len` tokens of the query.
        cached_len: how many leading tokens the model must not be fed again.
        matched_len: how many leading tokens matched stored ones (>= `cached_len`).
    """

    def __init__(self, store: PrefixCache, plan: Plan, cache: WorkingCache) -> None:
        self._store = store
        self._plan = plan
        self.cache = cache
        self.cached_len = plan.restore_len
        self.matched_len = plan.matched_len

    def release(self) -> None:
        """Unpin the entry; the cache stays usable."""
        self._store.release(self._plan)

    def __enter__(self) -> Lookup:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


class PrefixCache:
    """A prefix store for one model: pass it as `past_key_values` to `model.generate`.

    Each `generate` call through the store restores the longest usable cached prefix of the
    prompt, lets the model compute only the rest, and stores the finished sequence (prompt and
    answer) for later calls. Greedy outputs equal a cold run's; requests that cannot reuse
    safely run cold and are counted in `stats().fallbacks`.

    Stored entries live on three tiers, each with a byte budget: the model's device(s), host
    memory and, with `disk_dir`, disk. Past a budget the least valuable entries move to the
    next tier; they are dropped only when no tier can hold them. A hit on an entry off the
    device brings it back to the device of each layer.

    Args:
        model: a transformers generative model. Its `generate` is wrapped; calls that do not
            pass this store behave exactly as before.
        max_bytes: device budget for keys, values and snapshots (int or e.g. ``"2GB"``).
            Default: 30% of the GPU memory free once the model is loaded (CUDA), else a quarter of the
            host memory available when the store is made, up to 8 GiB. `stats()` shows the budgets.
        max_device_bytes: the same as `max_bytes` (give one of them).
        max_host_bytes: host-memory budget (pinned memory on CUDA). Default: a quarter of the host
            memory available, up to 16 GiB, for a CUDA model; 0 (no host tier) for a CPU model, whose
            device is the host.
        disk_dir: folder for the disk tier (``~`` expanded, created if missing, checked writable
            here); entries there survive a restart of the process.
        max_disk_bytes: disk budget (default: half the free space of `disk_dir`'s file system, at most 20 GiB).
        policy: ``"lru"`` (least recently used leaves first) or ``"cost"`` (keep what saves the
            most prefill work per byte; see `policy.py`).
        ttl: seconds (or a string like ``"30m"``, ``"1h"``) after which an unused entry is dropped (None: never).
        min_store_len: sequences shorter than this many tokens are not stored.
        max_entries: most entries (leaves) kept over all tiers (None: no limit).
        snapshot_interval: for models with recurrent layers, also snapshot the state every
            this many prompt tokens (None: only at prompt ends, answers ends and divergences).
        salt: isolates tenants: stores entries under a namespace no other salt shares.
        save_on_exit: with `disk_dir`, move what is in memory to disk when the process exits.
        attach: wrap `model.generate` (default). With False use `lookup`/`insert` yourself.
        max_encoder_bytes: encoder-decoder models served keyed by their encoder input
            (Whisper, BART, T5, ...): budget for stored encoder outputs, on the model's device and apart from
            `max_bytes` (default: an eighth of the device budget; 0 stores none).
        sliding_window_mode: how sliding-window layers are stored. ``"every_position"`` (default):
            like full attention, so any length restores. ``"window"``: one window of keys/values
            per snapshot point (prompt ends, answer ends, divergences; no interval snapshots), about
            the model's own cache for long prompts; a prefix then restores only at those points,
            and such a model runs batches and media prompts cold.
        remote: a Redis or Valkey URL (``redis://[user:password@]host:6379/0``, ``rediss://`` for
            TLS) for a tier shared by processes and machines, below the local ones (see `remote.py`).
            The server evicts: run it with `maxmemory` and ``maxmemory-policy allkeys-lru``.
        max_remote_bytes: the most bytes one entry may write to the remote tier (None: no limit).
        remote_write: ``"back"`` (default): entries are written when they leave the last local
            tier; ``"through"``: every new entry is also written when stored.
        remote_chunk_len: tokens per remote chunk (only whole chunks are shared). For recurrent
            models make it a multiple of `snapshot_interval`, so chunk ends carry snapshots.
        remote_ttl: seconds a written chunk lives on the server (None: until it is evicted).
        remote_timeout: seconds any one call to the server may wait.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).eval()
        >>> store = PrefixCache(model)
        >>> ids = torch.arange(4, 40)[None]
        >>> _ = model.generate(ids, past_key_values=store, max_new_tokens=4, do_sample=False)
        >>> _ = model.generate(ids, past_key_values=store, max_new_tokens=4, do_sample=False)
        >>> store.stats().hit_tokens
        35
    """

    def __init__(
        self,
        model: Any,
        *,
        max_bytes: int | str | None = None,
        max_device_bytes: int | str | None = None,
        max_host_bytes: int | str | None = None,
        disk_dir: str | os.PathLike[str] | None = None,
        max_disk_bytes: int | str | None = None,
        policy: str = "lru",
        ttl: float | str | None = None,
        min_store_len: int = 1,
        max_entries: int | None = None,
        snapshot_interval: int | None = 256,
        salt: str | None = None,
        save_on_exit: bool = True,
        attach: bool = True,
        max_encoder_bytes: int | str | None = None,
        sliding_window_mode: str = "every_position",
        remote: str | None = None,
        max_remote_bytes: int | str | None = None,
        remote_write: str = "back",
        remote_chunk_len: int = 256,
        remote_ttl: float | None = None,
        remote_timeout: float = 2.0,
    ) -> None:
        check_transformers()
        if sliding_window_mode not in SLIDING_WINDOW_MODES:
            raise ValueError(
                f"sliding_window_mode is one of {', '.join(SLIDING_WINDOW_MODES)}, got {sliding_window_mode!r}"
            )
        if snapshot_interval is not None and snapshot_interval < 1:
            raise ValueError(f"snapshot_interval must be a positive number of tokens or None, got {snapshot_interval}")
        if max_bytes is not None and max_device_bytes is not None:
            raise ValueError("give the device budget once: max_bytes or max_device_bytes, not both")
        ttl = parse_seconds(ttl) if ttl is not None else None
        if max_entries is not None and max_entries < 1:
            raise ValueError(f"max_entries is a positive count or None, got {max_entries}")
        if min_store_len < 1:
            raise ValueError(f"min_store_len is a positive number of tokens, got {min_store_len}")
        if max_disk_bytes is not None and disk_dir is None:
            raise ValueError("max_disk_bytes needs disk_dir: say where the disk tier lives")
        _check_remote_args(remote, max_remote_bytes, remote_write, remote_chunk_len, remote_ttl, remote_timeout)
        disk_root = usable_folder(disk_dir) if disk_dir is not None else None
        self.model = model
        self.profile: ModelProfile = profile_model(model, sliding_window_mode)
        device_budget = max_device_bytes if max_device_bytes is not None else max_bytes
        budgets = [
            parse_nbytes(device_budget) if device_budget is not None else default_max_bytes(model),
            parse_nbytes(max_host_bytes) if max_host_bytes is not None else default_host_bytes(model),
            0
            if disk_root is None
            else parse_nbytes(default_disk_bytes(disk_root) if max_disk_bytes is None else max_disk_bytes),
        ]
        self.snapshot_interval = snapshot_interval
        self.salt = salt
        self.ttl = ttl
        self.min_store_len = min_store_len
        self.max_entries = max_entries
        self._weights_probe = WeightsProbe(model)
        self._weights = (self._weights_probe.check(), weights_fingerprint(model))
        if _has_meta_parameters(model):
            # The probe notices the weights being loaded (new parameter objects and storage) and refingerprints.
            logger.warning(
                "%s has weights on the meta device: the store fingerprints them once they are loaded; "
                "its default budgets assume a CPU model (give max_bytes / max_host_bytes, or make the "
                "store after loading the weights)",
                type(model).__name__,
            )
        self._policy = make_policy(policy, len(self.profile.adapters))
        self._tree: RadixTree[Segment] = RadixTree(num_tiers=len(TIER_NAMES), score=self._policy.score)
        cuda = on_cuda(model)
        layout = Layout(
            len(self.profile.adapters), self.profile.kv_layers, self.profile.state_layers, self.profile.item_layers
        )
        self._placement = Placement(
            self._tree,
            budgets,
            Mover(pin=cuda, use_streams=cuda),
            DiskTier(disk_root, layout) if disk_root is not None else None,
            self._policy,
            self._state_device,
            _make_remote(remote, layout, max_remote_bytes, remote_chunk_len, remote_ttl, remote_timeout),
        )
        self.remote_write = remote_write
        if (
            remote is not None
            and self.profile.has_state
            and (snapshot_interval is None or remote_chunk_len % snapshot_interval)
        ):
            logger.warning(
                "remote_chunk_len=%d is not a multiple of snapshot_interval=%s: few remote chunks of this recurrent "
                "model will end at a snapshot, and only those can be reused",
                remote_chunk_len,
                snapshot_interval,
            )
        self._lock = threading.RLock()
        self._counters = _Counters()
        self._prefill_cost = PrefillCost.of(model, len(self.profile.kv_layers))
        self._request_callbacks: list[RequestCallback] = []
        self._warned: set[str] = set()
        self._namespace_cache: tuple[Any, str] | None = None
        self._state_devices: dict[int, torch.device] = {}
        self._pins: dict[tuple[str, tuple[int, ...]], Node[Segment]] = {}
        self._sessions: dict[str, Session] = {}
        self._pressure = PressureMonitor()
        self._next_expiry = 0.0
        self._hook: GenerateHook | None = None
        encoder_budget = self.max_bytes // 8 if self.profile.encoder_family is not None else 0
        self.encoder_outputs = EncoderOutputs(
            parse_nbytes(max_encoder_bytes) if max_encoder_bytes is not None else encoder_budget
        )
        if self.profile.unsupported is not None:
            logger.warning(
                "%s cannot reuse cached prefixes (%s); generate() through this store runs cold",
                type(model).__name__,
                self.profile.unsupported,
            )
        if disk_dir is not None and save_on_exit:
            atexit.register(_save_at_exit, weakref.ref(self))
        if attach:
            from hf_prefix_cache.integration.generate_hook import GenerateHook
            from hf_prefix_cache.integration.seq2seq import Seq2SeqHook
            from hf_prefix_cache.integration.whisper import WhisperHook

            hooks = {"whisper": WhisperHook, "seq2seq": Seq2SeqHook}
            self._hook = hooks.get(self.profile.encoder_family or "", GenerateHook)(self, model)

    # ------------------------------------------------------------------ public
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
            c = self._counters
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

    def _repr_html_(self) -> str:
        from hf_prefix_cache.store.display import store_html

        return store_html(self)

    def reset_stats(self) -> None:
        """Zero the request counters; stored entries stay."""
        with self._lock:
            self._counters = _Counters()
            self.encoder_outputs.hits = 0
            p = self._placement.counters
            p.evictions = p.evicted_bytes = p.offloads = p.reloads = p.skipped_files = 0
            remote = self._placement.remote
            if remote is not None:
                remote.counters = RemoteCounters()

    def clear(self) -> None:
        """Drop every stored entry, on every tier (disk files included), stored encoder outputs, pins and sessions."""
        self.encoder_outputs.clear()
        with self._lock:
            for session in list(self._sessions.values()):
                session._release()
            self._sessions.clear()
            self._pins.clear()
            removed = self._tree.clear()
            disk = self._placement.disk
            for ref in {
                id(n.value.disk): n.value.disk for n in removed if n.value is not None and n.value.disk
            }.values():
                if disk is not None and ref is not None:
                    disk.delete(ref.path)
            self._placement.counters.num_snapshots = 0
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

    def detach(self) -> None:
        """Unwrap `model.generate`; the store keeps its entries and its low-level API."""
        if self._hook is not None:
            self._hook.detach()
            self._hook = None

    def namespace(self) -> str:
        """The model's current namespace (recomputed when its dtype, adapters or weights change).

        A `WeightsProbe` check runs on every call (a few microseconds per parameter); see
        `keys.WeightsProbe` for what it notices and `invalidate` for what it cannot.
        """
        model = self.model
        with self._lock:
            version = self._weights_probe.check()
            if version != self._weights[0]:
                self._weights = (version, weights_fingerprint(model))
            probe = (getattr(model, "dtype", None), self._weights_probe.adapters, self._weights[1])
            cached = self._namespace_cache
            if cached is None or cached[0] != probe:
                namespace = model_namespace(model, self.salt, self._weights[1], self._weights_probe.adapters)
                if cached is not None and cached[1] != namespace:
                    logger.info(
                        "the model's weights, dtype or adapters changed: entries stored before are no longer used"
                    )
                cached = (probe, namespace)
                self._namespace_cache = cached
            return cached[1]

    def invalidate(self) -> None:
        """Forget everything stored, after changing the weights in a way the store cannot see.

        The store notices replaced parameters, in-place updates (`load_state_dict`, optimizer
        steps), switched adapters, and `.data` edits that touch the elements it samples. An
        in-place `.data` edit of only a few elements (one embedding row) can escape it: call
        this after one. Reads the weights again and drops every entry on every tier.

        Example:
            >>> model.model.embed_tokens.weight.data[7] += 1  # doctest: +SKIP
            >>> store.invalidate()  # doctest: +SKIP
        """
        with self._lock:
            self._weights = (self._weights_probe.check(), weights_fingerprint(self.model))
            self._namespace_cache = None
        self.clear()
        logger.info("invalidated: every stored entry was dropped")

    def session(self, name: str) -> Session:
        """The open session called `name` (made on first use): pass it as `past_key_values`.

        The conversation's latest entry stays pinned until `session.close()`.
        """
        with self._lock:
            session = self._sessions.get(name)
            if session is None or session.closed:
                session = self._sessions[name] = Session(self, name)
            return session

    def pin(self, token_ids: Any) -> int:
        """Keep the prefix `token_ids` (e.g. a system prompt) stored forever, never evicted or moved.

        `token_ids` is a tensor `[L]` or `[1, L]`, a list of ints, or what a tokenizer returns
        (`apply_chat_template(..., tokenize=True)`: its `input_ids` are used).

        Computes and stores it first if needed (one forward through the wrapped `generate`).
        Returns the pinned length. Undo with `unpin`.

        Raises:
            ValueError: when the prefix cannot be stored (model not served, over budget, or `attach=False`
                and not stored).
            TypeError: when the ids are not integers.

        Example:
            >>> store.pin(tok.apply_chat_template(system_turn, tokenize=True))  # doctest: +SKIP
        """
        tokens = _as_token_list(token_ids)
        if not tokens:
            raise ValueError("pin() needs at least one token id")
        if self.profile.encoder_family is not None:
            raise ValueError("cannot pin on an encoder-decoder model: its prefixes are keyed by the encoder input too")
        namespace = self.namespace()
        with self._lock:
            self._placement.index_disk(namespace)
            stored = self._tree.match(namespace, tokens).matched_len
        if stored < len(tokens):
            if self._hook is None or self.profile.unsupported is not None:
                raise ValueError(
                    f"cannot pin: only {stored} of {len(tokens)} tokens are stored and this store cannot compute "
                    "the rest (attach=True and a supported model are needed); generate with the prefix first"
                )
            ids = torch.tensor([tokens], device=self.model.device)
            self.model.generate(
                ids, attention_mask=torch.ones_like(ids), past_key_values=self, max_new_tokens=1, do_sample=False
            )
        with self._lock:
            if self._tree.match(namespace, tokens).matched_len < len(tokens):
                raise ValueError(
                    f"could not store the {len(tokens)}-token prefix: it does not fit the budgets "
                    f"{self.budgets} (or ran cold: see stats().fallbacks); nothing pinned. Pin a shorter "
                    "prefix or raise max_bytes"
                )
            result = self._tree.insert(namespace, tokens, _never_called)
            key = (namespace, tuple(tokens))
            if key not in self._pins:
                node = result.path[-1]
                self._tree.lock(node)
                self._pins[key] = node
                # A pinned prefix lives on the device; bring back any part that was offloaded.
                self._placement.bring_to_device(result.path, len(tokens))
            return len(tokens)

    def unpin(self, token_ids: torch.Tensor | Sequence[int]) -> bool:
        """Undo `pin`; returns whether that prefix was pinned."""
        key = (self.namespace(), tuple(_as_token_list(token_ids)))
        with self._lock:
            node = self._pins.pop(key, None)
            if node is None:
                return False
            self._tree.unlock(node)
            self._placement.enforce()
        self._after_unlock(())
        return True

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
        is logged, never raised into `generate`. `hf_prefix_cache.frontends.prometheus` builds on the
        stats instead, for scraping.

        Example:
            >>> events = []
            >>> store.on_request(events.append)                          # doctest: +SKIP
            >>> model.generate(ids, past_key_values=store)               # doctest: +SKIP
            >>> events[-1].hit_tokens_by_modality                        # doctest: +SKIP
            {'text': 35}
        """
        with self._lock:
            self._request_callbacks.append(callback)

    def lookup(self, input_ids: torch.Tensor | Sequence[int]) -> Lookup:
        """Restore the longest usable stored prefix of `input_ids` into a fresh working cache.

        For custom forward loops: feed the model `input_ids[:, lookup.cached_len:]` with
        `past_key_values=lookup.cache`, then call `insert` with the ids the cache now covers.

        Example:
            >>> with store.lookup(ids) as hit:  # doctest: +SKIP
            ...     out = model(ids[:, hit.cached_len:], past_key_values=hit.cache, use_cache=True)
            >>> store.insert(ids, hit.cache)  # doctest: +SKIP

        Raises:
            ValueError: when the model cannot be served (reason in the message) or the ids are not one sequence.
        """
        if self.profile.unsupported is not None:
            raise ValueError(f"{type(self.model).__name__} cannot reuse cached prefixes: {self.profile.unsupported}")
        tokens = _as_token_list(input_ids)
        if not tokens:
            raise ValueError("lookup() needs at least one token id")
        _check_manual_media(self.profile, tokens)
        plan = self.acquire(self.namespace(), tokens)
        cache = self.new_cache()
        if plan.restore_len:
            cache.restore(plan.restore_len, plan.keys, plan.values, plan.snapshot)
        return Lookup(self, plan, cache)

    def insert(self, token_ids: torch.Tensor | Sequence[int], cache: WorkingCache) -> int:
        """Store `cache`, which must hold exactly the states of `token_ids`; returns new tokens stored.

        Raises:
            ValueError: when the cache's length disagrees with the ids, or it is not a working cache of this store.
        """
        if not isinstance(cache, WorkingCache) or cache.profile is not self.profile:
            raise ValueError("insert() takes a cache made by this store's lookup() or new_cache()")
        tokens = _as_token_list(token_ids)
        _check_manual_media(self.profile, tokens)
        kv_len = cache.kv_length()
        if kv_len is not None and kv_len != len(tokens):
            raise ValueError(f"the cache holds {kv_len} positions but {len(tokens)} token ids were given")
        return self.insert_sequence(self.namespace(), tokens, cache, [])

    def new_cache(self) -> WorkingCache:
        """An empty working cache for this model."""
        return WorkingCache(self.profile)

    def check_integrity(self) -> None:
        """Raise `RuntimeError` when stored bytes, runs, files or snapshots disagree with the tree."""
        with self._lock:
            self._tree.check_integrity()
            covered: dict[int, list[tuple[int, int]]] = {}
            runs: dict[int, Run] = {}
            disk_refs: Counter[int] = Counter()
            refs: dict[int, Any] = {}
            num_snapshots = 0
            for node in self._tree.iter_nodes():
                seg = node.value
                assert seg is not None
                num_snapshots += len(seg.snapshots)
                if (seg.start, seg.end) != (node.start, node.end):
                    raise RuntimeError(f"{node} holds a segment of [{seg.start}, {seg.end})")
                if any(not seg.start < n <= seg.end for n in seg.snapshots):
                    raise RuntimeError(f"{node} holds snapshots outside its range: {sorted(seg.snapshots)}")
                if any(not seg.start < n <= seg.end for n in seg.items):
                    raise RuntimeError(f"{node} holds item states outside its range: {sorted(seg.items)}")
                on_disk = seg.disk is not None
                if on_disk != (node.tier == DISK):
                    raise RuntimeError(f"{node} sits on tier {TIER_NAMES[node.tier]} but disk={on_disk}")
                if seg.disk is not None:
                    disk_refs[id(seg.disk)] += 1
                    refs[id(seg.disk)] = seg.disk
                    if seg.run is not None:
                        raise RuntimeError(f"{node} is on disk but holds a run")
                if seg.run is not None:
                    runs[id(seg.run)] = seg.run
                    covered.setdefault(id(seg.run), []).append((seg.start, seg.end))
                    want = "cpu" if node.tier == HOST else None
                    for t in seg.run.keys:
                        if t is not None and want is not None and t.device.type != want:
                            raise RuntimeError(f"{node} is on the host tier but holds tensors on {t.device}")
            if num_snapshots != self._placement.counters.num_snapshots:
                raise RuntimeError(
                    f"counted {self._placement.counters.num_snapshots} snapshots, the tree holds {num_snapshots}"
                )
            for key, count in disk_refs.items():
                if refs[key].num_refs != count:
                    raise RuntimeError(f"{refs[key].path} counts {refs[key].num_refs} refs, tree has {count}")
            for key, run in runs.items():
                for t in run.keys + run.values:
                    held = t.untyped_storage().nbytes() if t is not None else 0
                    if t is not None and held != t.nbytes:
                        raise RuntimeError(f"run [{run.lo}, {run.hi}) keeps {held} bytes for a tensor of {t.nbytes}")
                spans = sorted(covered[key])
                if run.num_refs != len(spans):
                    raise RuntimeError(f"run [{run.lo}, {run.hi}) counts {run.num_refs} refs, tree has {len(spans)}")
                if (
                    spans[0][0] != run.lo
                    or spans[-1][1] != run.hi
                    or any(spans[i][1] != spans[i + 1][0] for i in range(len(spans) - 1))
                ):
                    raise RuntimeError(f"run [{run.lo}, {run.hi}) is covered by {spans}")

    def __getattr__(self, name: str) -> Any:
        if name in _CACHE_API:
            raise _NotAWorkingCacheError(
                f"PrefixCache has no {name!r}: it is a store, not a transformers Cache. Pass it to the generate() "
                f"of the model object it was built for ({type(self.__dict__.get('model')).__name__} at "
                f"{id(self.__dict__.get('model')):#x}; another model, even of the same class, needs its own "
                "PrefixCache(model)), or use store.lookup(ids).cache in a custom forward loop."
            )
        raise AttributeError(name)

    # --------------------------------------------------- used by the hook
    def count_fallback(self, reason: str, prompt_len: int, log: bool = True) -> None:
        """Count a request run cold for `reason`; with `log`, also log it (see `log_fallback`)."""
        with self._lock:
            self._counters.requests += 1
            self._counters.prompt_tokens += prompt_len
            self._counters.computed_tokens += prompt_len
            self._counters.fallbacks[reason] += 1
            callbacks = list(self._request_callbacks)
        if log:
            self.log_fallback(reason)
        if callbacks:
            _notify(callbacks, RequestEvent(prompt_len, 0, fallback=reason))

    def log_fallback(self, reason: str) -> None:
        """Log a cold run: a WARNING the first time a reason occurs in this store, DEBUG after."""
        self._log_once(reason, "prefix cache skipped, running cold: %s", reason)

    def _log_once(self, kind: str, message: str, *args: Any) -> None:
        """Log a WARNING the first time `kind` happens in this store, DEBUG after that."""
        with self._lock:
            first = kind not in self._warned
            self._warned.add(kind)
        logger.log(logging.WARNING if first else logging.DEBUG, message, *args)

    def count_event(self, reason: str) -> None:
        """Count `reason` in `fallbacks` for a request that was served (and stored) but reused less."""
        with self._lock:
            self._counters.fallbacks[reason] += 1

    def has_entries(self, namespace: str) -> bool:
        """Whether the tree holds anything under `namespace` (disk files are not indexed for this)."""
        with self._lock:
            return namespace in self._tree.namespaces()

    def count_request(
        self, prompt_len: int, restore_len: int, num_rows: int = 1, symbols: Sequence[Hashable] | None = None
    ) -> None:
        """Count a served request; `symbols` (the prompt's tree symbols) split its hits by modality."""
        by_modality = hit_tokens_by_modality(symbols, restore_len, num_rows)
        # Without the cache, positions [0, restore_len) would have been prefilled too.
        saved = self._prefill_cost.flops(0, restore_len) * num_rows
        with self._lock:
            c = self._counters
            c.requests += 1
            c.prompt_tokens += prompt_len * num_rows
            c.hit_tokens += restore_len * num_rows
            c.computed_tokens += (prompt_len - restore_len) * num_rows
            c.hit_requests += restore_len > 0
            c.hit_by_modality.update(by_modality)
            c.saved_prefill_flops += saved
            callbacks = list(self._request_callbacks)
        if callbacks:
            _notify(callbacks, RequestEvent(prompt_len, restore_len, num_rows, by_modality, saved))

    def relieve_device(self) -> None:
        """Move every unpinned entry off the device (after an out-of-memory error)."""
        with self._lock:
            self._placement.free_device()
        self._after_unlock(())
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def acquire(
        self,
        namespace: str,
        tokens: Sequence[int],
        limit: int | None = None,
        *,
        spans: Sequence[tuple[int, int]] = (),
        item_spans: Sequence[tuple[int, int]] = (),
    ) -> Plan:
        """Match `tokens`, pin the matched path, and gather what restoring it needs.

        Restores at most `limit` tokens (default: all but the last, which is fed for its logits),
        never cutting inside one of the media `spans` (`[start, end)` positions). Media items
        whose spans are in `item_spans` (prompt order) restore with their stored item states; a
        prefix is cut before the first such item it holds without one. Entries off the device
        are brought back first; a disk file found corrupt is dropped and the match retried.

        Raises:
            torch.OutOfMemoryError: bringing an entry back to the device did not fit (nothing is pinned then).
        """
        if limit is None:
            limit = len(tokens) - 1
        if self._placement.remote is not None:
            self._fetch_remote(namespace, tokens, limit)
        while True:
            with self._lock:
                self._maintain(namespace)
                match = self._tree.match(namespace, tokens)
                cap = clamp_below_spans(min(match.matched_len, limit), spans)
                restore_len, path = cap, match.path
                if self.profile.has_state:
                    restore_len, _ = best_snapshot([n.value for n in path if n.value is not None], cap)
                if path:
                    self._tree.lock(path[-1])
                try:
                    segments = self._placement.bring_to_device(path, restore_len)
                except CorruptFileError as exc:
                    self._drop_corrupt(path, exc)
                    continue
                except BaseException:
                    if path:
                        self._tree.unlock(path[-1])
                    raise
                snapshot = None
                if self.profile.has_state:
                    found, snapshot = best_snapshot(segments, restore_len)
                    assert found == restore_len, f"snapshot at {found}, planned {restore_len}"
                items: list[Snapshot] = []
                if item_spans:
                    assert not self.profile.has_state, "item states are for attention-only models"
                    restore_len, items = item_states(segments, item_spans, restore_len)
                pieces = kv_pieces(segments, restore_len)
                calls = self._pressure_calls()
            break
        self._after_unlock(calls)
        # Joining pieces may copy; outside the lock. The views stay valid: a compaction swaps a
        # run's tensors for new ones and never writes into the old ones.
        keys = values = None
        try:
            if restore_len > 0 and self.profile.has_kv:
                keys, values = join_kv(pieces)
        except BaseException:
            with self._lock:
                if path:
                    self._tree.unlock(path[-1])
            raise
        return Plan(namespace, restore_len, match.matched_len, keys, values, snapshot, path, items=items)

    def release(self, plan: Plan) -> None:
        with self._lock:
            if not plan.released:
                plan.released = True
                if plan.path:
                    self._tree.unlock(plan.path[-1])

    def insert_sequence(
        self,
        namespace: str,
        tokens: Sequence[int],
        cache: WorkingCache,
        snapshots: Sequence[Snapshot],
        row: int | None = None,
        session: Session | None = None,
        items: Sequence[Snapshot] = (),
        computed_from: int = 0,
    ) -> int:
        """Store the states in `cache` for `tokens` (all of them), plus earlier `snapshots`.

        Positions from `computed_from` on, `snapshots` and `items` were computed by this request:
        if any of them holds NaN or infinity (a poisoned image, an adapter gone wrong), nothing
        is stored, since later requests sharing the prefix would inherit it; the skip is counted
        as `non_finite_states`.

        `row` picks one row of a batched cache; its new tokens are then always copied out,
        since the batch's tensors hold every row. `session`, when given, pins the stored entry.
        `items` are media item states, each kept by the node holding its placeholder's end
        (nodes that already hold one keep theirs).
        """
        length = len(tokens)
        if length == 0:
            return 0
        if length < self.min_store_len:
            with self._lock:
                self._counters.fallbacks["entry_below_min_store_len"] += 1
            return 0
        assert row is None or not self.profile.has_state, "batched inserts are for attention-only models"
        if not self.profile.has_state and not items and self._touch_if_stored(namespace, tokens, session):
            return 0  # an exact repeat: nothing new to capture
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
            with self._lock:
                self._counters.fallbacks["non_finite_states"] += 1
            self._log_once(
                "non_finite_states",
                "not storing %d tokens: their states hold NaN or infinity (check the inputs, e.g. pixel values)",
                length,
            )
            return 0
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
                self._counters.fallbacks["entry_over_budget"] += 1
                logger.info(
                    "not storing %d new tokens (%d bytes): larger than every tier's budget (at most %d)",
                    length - matched_len,
                    new_nbytes,
                    largest,
                )
                return 0
            result = self._tree.insert(namespace, tokens, lambda a, b: Segment(run, a, b, nbytes_per_token))
            if run is not None and result.new_node is not None:
                run.num_refs += 1
                self._place_run(run, result.path[:-1], result.matched_len, length, may_move=row is None)
            on_disk: dict[int, tuple[Node[Segment], list[Snapshot]]] = {}
            for snap in all_snapshots:
                self._attach_snapshot(result.path, snap, on_disk)
            for node, snaps in on_disk.values():
                self._placement.add_to_file(node, snaps)
            for state in items:
                self._attach_item(result.path, state)
            self._tree.touch(result.path)
            if result.new_node is not None:
                self._placement.settle(result.path)
                if self.remote_write == "through":
                    self._placement.write_remote(result.path[-1])
            if session is not None and result.path:
                session.hold(result.path[-1])
            self._placement.enforce()
            if self.max_entries is not None and self._tree.num_leaves > self.max_entries:
                self._placement.drop_leaves(self._tree.num_leaves - self.max_entries)
            calls = self._pressure_calls()
        self._after_unlock(calls)
        if length > result.matched_len:
            logger.info("prefix cache: stored %d new tokens (%d in all)", length - result.matched_len, length)
        return length - result.matched_len

    # ----------------------------------------------------------------- helpers
    def _fetch_remote(self, namespace: str, tokens: Sequence[int], limit: int) -> None:
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
            self.count_event(hit.error)
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

    def _touch_if_stored(self, namespace: str, tokens: Sequence[int], session: Session | None) -> bool:
        """If all of `tokens` is stored already, mark it used (and held by `session`) and say so."""
        with self._lock:
            self._maintain(namespace)
            match = self._tree.match(namespace, tokens)
            if match.matched_len != len(tokens) or not match.path or match.path[-1].end != len(tokens):
                return False
            self._tree.touch(match.path)
            if session is not None:
                session.hold(match.path[-1])
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
            self._counters.expired += len(stale)

    def _drop_corrupt(self, path: Sequence[Node[Segment]], exc: Exception) -> None:
        self._tree.unlock(path[-1])
        bad = next(
            n for n in path if n.value is not None and n.value.disk is not None and str(n.value.disk.path) in str(exc)
        )
        logger.warning("dropping a stored prefix whose file is unusable: %s", exc)
        self._placement.counters.skipped_files += 1
        self._placement.drop(bad)

    def _place_run(
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
                run.num_refs += 1
        else:
            run.compact(matched_len, length)

    def _attach_snapshot(
        self, path: Sequence[Node[Segment]], snap: Snapshot, on_disk: dict[int, tuple[Node[Segment], list[Snapshot]]]
    ) -> None:
        """Give `snap` to the node of `path` whose range holds its length; a disk node's go to `on_disk`.

        Budgets are enforced once after all of an insert's snapshots are attached: enforcing after
        each one sent the entry to disk after its first snapshot and lost the rest.
        """
        for node in path:
            if node.start < snap.length <= node.end:
                seg = node.value
                assert seg is not None
                if snap.length not in seg.snapshots:
                    if node.tier == DISK:
                        # Its file is rewritten once with every new snapshot of this insert.
                        on_disk.setdefault(id(node), (node, []))[1].append(snap)
                        return
                    seg.snapshots[snap.length] = (
                        snap if node.tier == DEVICE else snapshot_to_host(snap, self._placement.mover)
                    )
                    self._placement.counters.num_snapshots += 1
                    self._tree.refresh_nbytes(node)
                return

    def _attach_item(self, path: Sequence[Node[Segment]], state: Snapshot) -> None:
        for node in path:
            if node.start < state.length <= node.end:
                seg = node.value
                assert seg is not None
                if state.length not in seg.items and node.tier != DISK:  # a file is not rewritten for one item
                    seg.items[state.length] = (
                        state if node.tier == DEVICE else snapshot_to_host(state, self._placement.mover)
                    )
                    self._tree.refresh_nbytes(node)
                return

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
        _fire(calls)

    def _pressure_calls(self) -> list[Any]:
        return self._pressure.check(TIER_NAMES, self._tree.tier_nbytes, self._placement.budgets)

    # sessions call these under the store's lock
    def _lock_node(self, node: Node[Segment]) -> None:
        self._tree.lock(node)

    def _unlock_node(self, node: Node[Segment]) -> None:
        self._tree.unlock(node)

    def _end_session(self, session: Session) -> None:
        with self._lock:
            session._release()
            if self._sessions.get(session.name) is session:
                del self._sessions[session.name]
            self._placement.enforce()
        self._after_unlock(())


def _fire(calls: Sequence[Any]) -> None:
    for callback, event in calls:
        try:
            callback(event)
        except Exception:  # an app's callback must not break generation
            logger.exception("memory-pressure callback failed")


def _notify(callbacks: Sequence[RequestCallback], event: RequestEvent) -> None:
    for callback in callbacks:
        try:
            callback(event)
        except Exception:  # an exporter must not break generation
            logger.exception("on_request callback failed")


def _save_at_exit(ref: weakref.ref[PrefixCache]) -> None:
    store = ref()
    if store is not None:
        try:
            store.save()
        except Exception:  # at exit, a failed save only loses what was in memory anyway
            logger.exception("could not save the prefix cache to disk at exit")


def _never_called(start: int, end: int) -> Segment:
    raise AssertionError("pin() inserts only what is already stored")


def _check_remote_args(
    remote: str | None,
    max_remote_bytes: int | str | None,
    remote_write: str,
    chunk_len: int,
    ttl: float | None,
    timeout: float,
) -> None:
    if remote is None:
        given = [name for name, value in (("max_remote_bytes", max_remote_bytes), ("remote_ttl", ttl)) if value]
        if given or remote_write != "back":
            raise ValueError(f"{', '.join(given) or 'remote_write'} needs remote: give the server's URL")
        return
    if not isinstance(remote, str):
        raise TypeError(f"remote is a URL string such as 'redis://localhost:6379/0', got {type(remote).__name__}")
    if remote_write not in ("back", "through"):
        raise ValueError(f"remote_write is 'back' or 'through', got {remote_write!r}")
    if chunk_len < 1:
        raise ValueError(f"remote_chunk_len is a positive number of tokens, got {chunk_len}")
    if ttl is not None and ttl <= 0:
        raise ValueError(f"remote_ttl is a positive number of seconds or None, got {ttl}")
    if timeout <= 0:
        raise ValueError(f"remote_timeout is a positive number of seconds, got {timeout}")


def _make_remote(
    url: str | None,
    layout: Layout,
    max_remote_bytes: int | str | None,
    chunk_len: int,
    ttl: float | None,
    timeout: float,
) -> RemoteTier | None:
    if url is None:
        return None
    return RemoteTier(
        url,
        layout,
        chunk_len=chunk_len,
        ttl=ttl,
        timeout=timeout,
        max_write_bytes=parse_nbytes(max_remote_bytes) if max_remote_bytes is not None else None,
    )


def _check_manual_media(profile: ModelProfile, tokens: Sequence[int]) -> None:
    """`lookup`/`insert` key token ids only: refuse what only `generate` keys exactly.

    That is media, M-RoPE, prefix-LM, and encoder-decoder models (keyed by their encoder input).
    """
    problem = profile.media.manual_problem(tokens) if profile.media is not None else None
    if profile.encoder_family is not None:
        problem = "encoder-decoder"
    if problem is not None:
        raise ValueError(
            f"lookup()/insert() key token ids only and cannot serve this {problem} request exactly; "
            "use model.generate(**inputs, past_key_values=store), which keys media by content"
        )


def _has_meta_parameters(model: Any) -> bool:
    return any(p.is_meta for p in model.parameters())


def _as_token_list(ids: Any) -> list[int]:
    """Token ids from a tensor `[L]`/`[1, L]`, a list of ints, or a tokenizer's output (`input_ids` inside).

    Raises:
        TypeError: for float ids or anything else that is not token ids.
        ValueError: for a batch of several sequences.
    """
    if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):
        # apply_chat_template(tokenize=True, return_dict=True) and tokenizer(...) give a BatchEncoding.
        ids = ids["input_ids"] if isinstance(ids, Mapping) else ids.input_ids
    if isinstance(ids, torch.Tensor) and (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool):
        raise TypeError(f"token ids must be integers, got a {ids.dtype} tensor; pass input_ids, e.g. ids.long()")
    if not isinstance(ids, torch.Tensor):
        if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
            raise TypeError(f"expected token ids (a tensor or a list of ints), got {type(ids).__name__}")
        if ids and isinstance(ids[0], Sequence) and not isinstance(ids[0], str):
            if len(ids) != 1:
                raise ValueError(f"expected one sequence, got a batch of {len(ids)}; use rows one at a time")
            ids = ids[0]
        bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral | torch.Tensor)), None)
        if bad is not None:
            raise TypeError(f"token ids must be integers, got {bad!r} ({type(bad).__name__})")
    if isinstance(ids, torch.Tensor):
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise ValueError(f"expected one sequence, got a batch of {ids.shape[0]}; look up rows one at a time")
            ids = ids[0]
        if ids.dim() != 1:
            raise ValueError(f"expected token ids of shape [L] or [1, L], got {tuple(ids.shape)}")
        return [int(t) for t in ids.tolist()]
    return [int(t) for t in ids]
