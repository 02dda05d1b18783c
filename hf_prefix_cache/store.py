"""PrefixCache: the store users hand to `generate`, and its low-level `lookup`/`insert` API.

Owns the radix tree of token ids, the key/value runs and state snapshots its nodes point to,
the byte budget and the counters. Every tree mutation happens under one lock, so several
threads may generate through one store. Running the model is not this module's job: the
generation hook (`hook.py`) does that and calls `acquire`/`release`/`insert_sequence` here.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ._compat import check_transformers
from .cache import WorkingCache
from .keys import model_namespace
from .media import clamp_below_spans
from .profile import ModelProfile, profile_model
from .radix import Node, RadixTree
from .segments import Run, Segment, Snapshot, join_kv, kv_pieces
from .stats import CacheStats

if TYPE_CHECKING:
    from types import TracebackType

    from .hook import GenerateHook

logger = logging.getLogger("hf_prefix_cache")

_GiB = 1 << 30
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_nbytes(size: int | str) -> int:
    """`4096`, `"512MB"`, `"1.5 GiB"` -> bytes.

    Raises:
        ValueError: for a negative size or an unknown unit.
    """
    if isinstance(size, bool):
        raise TypeError("a byte size must be an int or a string like '4GB', not a bool")
    if isinstance(size, int):
        value = size
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", size)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read {size!r} as a byte size; write e.g. 4096, '512MB' or '4GiB'")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value < 0:
        raise ValueError(f"a byte size cannot be negative, got {size!r}")
    return value


def default_max_bytes(model: Any) -> int:
    """30% of free GPU memory for a CUDA model; otherwise a quarter of RAM, at most 8 GiB."""
    device = getattr(model, "device", torch.device("cpu"))
    if device.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.3)
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 16 * _GiB
    return min(ram // 4, 8 * _GiB)


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
    """What one request takes from the store: the first `restore_len` tokens, pinned until `release`."""

    namespace: str
    restore_len: int
    matched_len: int
    keys: list[torch.Tensor | None] | None
    values: list[torch.Tensor | None] | None
    snapshot: Snapshot | None
    path: tuple[Node[Segment], ...]
    released: bool = False


@dataclass(slots=True)
class _Counters:
    requests: int = 0
    hit_requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    computed_tokens: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    fallbacks: Counter[str] = field(default_factory=Counter)


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

    Args:
        model: a transformers generative model. Its `generate` is wrapped; calls that do not
            pass this store behave exactly as before.
        max_bytes: byte budget for stored keys, values and snapshots (int or e.g. ``"2GB"``).
            Default: 30% of free GPU memory on CUDA, else a quarter of RAM up to 8 GiB.
        snapshot_interval: for models with recurrent layers, also snapshot the state every
            this many prompt tokens (None: only at prompt ends, answers ends and divergences).
        salt: isolates tenants: stores entries under a namespace no other salt shares.
        attach: wrap `model.generate` (default). With False use `lookup`/`insert` yourself.

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
        snapshot_interval: int | None = 256,
        salt: str | None = None,
        attach: bool = True,
    ) -> None:
        check_transformers()
        if snapshot_interval is not None and snapshot_interval < 1:
            raise ValueError(f"snapshot_interval must be a positive number of tokens or None, got {snapshot_interval}")
        self.model = model
        self.profile: ModelProfile = profile_model(model)
        self.max_bytes = parse_nbytes(max_bytes) if max_bytes is not None else default_max_bytes(model)
        self.snapshot_interval = snapshot_interval
        self.salt = salt
        self._tree: RadixTree[Segment] = RadixTree()
        self._lock = threading.RLock()
        self._counters = _Counters()
        self._num_snapshots = 0
        self._warned: set[str] = set()
        self._namespace_cache: tuple[Any, str] | None = None
        self._hook: GenerateHook | None = None
        if self.profile.unsupported is not None:
            logger.warning(
                "%s cannot reuse cached prefixes (%s); generate() through this store runs cold",
                type(model).__name__,
                self.profile.unsupported,
            )
        if attach:
            from .hook import GenerateHook

            self._hook = GenerateHook(self, model)

    # ------------------------------------------------------------------ public
    def stats(self) -> CacheStats:
        """Counters and current size, as an immutable snapshot."""
        with self._lock:
            c = self._counters
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
                snapshots=self._num_snapshots,
                evictions=c.evictions,
                evicted_bytes=c.evicted_bytes,
                fallbacks=dict(c.fallbacks),
            )

    def reset_stats(self) -> None:
        """Zero the counters; stored entries stay."""
        with self._lock:
            self._counters = _Counters()

    def clear(self) -> None:
        """Drop every stored entry (pinned ones too: their users keep their own references)."""
        with self._lock:
            self._tree.clear()
            self._num_snapshots = 0

    def detach(self) -> None:
        """Unwrap `model.generate`; the store keeps its entries and its low-level API."""
        if self._hook is not None:
            self._hook.detach()
            self._hook = None

    def namespace(self) -> str:
        """The model's current namespace (recomputed when its dtype or adapters change)."""
        model = self.model
        probe = (getattr(model, "dtype", None), _active_adapters(model))
        cached = self._namespace_cache
        if cached is None or cached[0] != probe:
            cached = (probe, model_namespace(model, self.salt))
            self._namespace_cache = cached
        return cached[1]

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
        """Raise `RuntimeError` when stored bytes, runs or snapshots disagree with the tree."""
        with self._lock:
            self._tree.check_integrity()
            covered: dict[int, list[tuple[int, int]]] = {}
            runs: dict[int, Run] = {}
            num_snapshots = 0
            for node in self._tree.iter_nodes():
                seg = node.value
                assert seg is not None
                num_snapshots += len(seg.snapshots)
                if (seg.start, seg.end) != (node.start, node.end):
                    raise RuntimeError(f"{node} holds a segment of [{seg.start}, {seg.end})")
                if any(not seg.start < n <= seg.end for n in seg.snapshots):
                    raise RuntimeError(f"{node} holds snapshots outside its range: {sorted(seg.snapshots)}")
                if seg.run is not None:
                    runs[id(seg.run)] = seg.run
                    covered.setdefault(id(seg.run), []).append((seg.start, seg.end))
            if num_snapshots != self._num_snapshots:
                raise RuntimeError(f"counted {self._num_snapshots} snapshots, the tree holds {num_snapshots}")
            for key, run in runs.items():
                for t in run.keys + run.values:
                    held = t.untyped_storage().nbytes() if t is not None else 0
                    if t is not None and held != t.nbytes:
                        raise RuntimeError(f"run [{run.lo}, {run.hi}) keeps {held} bytes for a tensor of {t.nbytes}")
                spans = sorted(covered[key])
                if run.num_refs != len(spans):
                    raise RuntimeError(f"run [{run.lo}, {run.hi}) counts {run.num_refs} refs, tree has {len(spans)}")
                joined = [spans[0][0]] + [b for a, b in spans]
                if (
                    spans[0][0] != run.lo
                    or spans[-1][1] != run.hi
                    or any(spans[i][1] != spans[i + 1][0] for i in range(len(spans) - 1))
                ):
                    raise RuntimeError(f"run [{run.lo}, {run.hi}) is covered by {spans} ({joined})")

    def __getattr__(self, name: str) -> Any:
        if name in _CACHE_API:
            raise _NotAWorkingCacheError(
                f"PrefixCache has no {name!r}: it is a store, not a transformers Cache. Pass it to the generate() "
                f"of the model it was built for ({type(self.__dict__.get('model')).__name__}), or use "
                "store.lookup(ids).cache in a custom forward loop."
            )
        raise AttributeError(name)

    # --------------------------------------------------- used by the hook
    def count_fallback(self, reason: str, prompt_len: int) -> None:
        with self._lock:
            self._counters.requests += 1
            self._counters.prompt_tokens += prompt_len
            self._counters.computed_tokens += prompt_len
            self._counters.fallbacks[reason] += 1
            first = reason not in self._warned
            self._warned.add(reason)
        (logger.warning if first else logger.info)("prefix cache skipped, running cold: %s", reason)

    def count_request(self, prompt_len: int, restore_len: int, num_rows: int = 1) -> None:
        with self._lock:
            c = self._counters
            c.requests += 1
            c.prompt_tokens += prompt_len * num_rows
            c.hit_tokens += restore_len * num_rows
            c.computed_tokens += (prompt_len - restore_len) * num_rows
            c.hit_requests += restore_len > 0

    def acquire(
        self, namespace: str, tokens: Sequence[int], limit: int | None = None, *, spans: Sequence[tuple[int, int]] = ()
    ) -> Plan:
        """Match `tokens`, pin the matched path, and gather what restoring it needs.

        Restores at most `limit` tokens (default: all but the last, which is fed for its logits),
        never cutting inside one of the media `spans` (`[start, end)` positions).
        """
        if limit is None:
            limit = len(tokens) - 1
        with self._lock:
            match = self._tree.match(namespace, tokens)
            limit = clamp_below_spans(min(match.matched_len, limit), spans)
            restore_len, snapshot = limit, None
            if self.profile.has_state:
                restore_len, snapshot = _best_snapshot(match.path, limit)
            path = match.path
            if path:
                self._tree.lock(path[-1])
            pieces = kv_pieces([node.value for node in path if node.value is not None], restore_len)
        # Joining pieces may copy; outside the lock. The views stay valid: a compaction swaps a
        # run's tensors for new ones and never writes into the old ones.
        keys = values = None
        if restore_len > 0 and self.profile.has_kv:
            keys, values = join_kv(pieces)
        return Plan(namespace, restore_len, match.matched_len, keys, values, snapshot, path)

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
    ) -> int:
        """Store the states in `cache` for `tokens` (all of them), plus earlier `snapshots`.

        `row` picks one row of a batched cache; its new tokens are then always copied out,
        since the batch's tensors hold every row.
        """
        length = len(tokens)
        if length == 0:
            return 0
        assert row is None or not self.profile.has_state, "batched inserts are for attention-only models"
        run = cache.capture_run(length, row) if self.profile.has_kv else None
        all_snapshots = list(snapshots)
        if self.profile.has_state:
            all_snapshots.append(cache.snapshot(length))
        nbytes_per_token = run.nbytes_per_token if run is not None else 0
        with self._lock:
            matched_len = self._tree.match(namespace, tokens).matched_len
            new_nbytes = (length - matched_len) * nbytes_per_token + sum(s.nbytes for s in all_snapshots)
            if new_nbytes > self.max_bytes:
                self._counters.fallbacks["entry_over_budget"] += 1
                logger.info(
                    "not storing %d new tokens (%d bytes): over max_bytes=%d",
                    length - matched_len,
                    new_nbytes,
                    self.max_bytes,
                )
                return 0
            result = self._tree.insert(namespace, tokens, lambda a, b: Segment(run, a, b, nbytes_per_token))
            if run is not None and result.new_node is not None:
                run.num_refs += 1
                self._place_run(run, result.path[:-1], result.matched_len, length, may_move=row is None)
            for snap in all_snapshots:
                self._attach_snapshot(result.path, snap)
            self._tree.touch(result.path)
            self._evict(self._tree.total_nbytes - self.max_bytes)
            return length - result.matched_len

    # ----------------------------------------------------------------- helpers
    def _place_run(
        self, run: Run, matched: Sequence[Node[Segment]], matched_len: int, length: int, may_move: bool
    ) -> None:
        """Make `run` (positions `[0, length)`) back the new leaf without holding a second copy of the prefix.

        When the matched nodes' runs back nothing else, they move onto `run` and their old
        tensors are freed: restores along this path stay one view. Otherwise only the new
        tail `[matched_len, length)` is kept, copied out so the prefix copy can be freed.
        """
        counts: Counter[int] = Counter()
        old_runs: dict[int, Run] = {}
        for node in matched:
            seg = node.value
            assert seg is not None and seg.run is not None
            counts[id(seg.run)] += 1
            old_runs[id(seg.run)] = seg.run
        if may_move and all(old_runs[key].num_refs == count for key, count in counts.items()):
            for node in matched:
                assert node.value is not None
                node.value.run = run
                run.num_refs += 1
        else:
            run.compact(matched_len, length)

    def _attach_snapshot(self, path: Sequence[Node[Segment]], snap: Snapshot) -> None:
        for node in path:
            if node.start < snap.length <= node.end:
                seg = node.value
                assert seg is not None
                if snap.length not in seg.snapshots:
                    seg.snapshots[snap.length] = snap
                    self._num_snapshots += 1
                    self._tree.refresh_nbytes(node)
                return

    def _evict(self, nbytes_to_free: int) -> None:
        evicted = self._tree.evict(nbytes_to_free)
        if evicted:
            self._counters.evictions += len(evicted)
            self._counters.evicted_bytes += sum(node.nbytes for node in evicted)
            segments = [node.value for node in evicted if node.value is not None]
            self._num_snapshots -= sum(len(seg.snapshots) for seg in segments)
            _release_segments(segments)


def _release_segments(segments: Sequence[Segment]) -> None:
    """Drop the removed segments' references; compact each run still in use to what is left of it."""
    shrunk: dict[int, tuple[Run, int]] = {}
    for seg in segments:
        run = seg.run
        if run is None:
            continue
        run.num_refs -= 1
        # Removed nodes are leaves, so a removed segment is the tail of its run.
        assert seg.end == run.hi or id(run) in shrunk, f"segment [{seg.start}, {seg.end}) is not the tail of its run"
        hi = min(seg.start, shrunk[id(run)][1]) if id(run) in shrunk else seg.start
        shrunk[id(run)] = (run, hi)
    for run, hi in shrunk.values():
        if run.num_refs > 0:
            run.compact(run.lo, hi)


def _best_snapshot(path: Sequence[Node[Segment]], limit: int) -> tuple[int, Snapshot | None]:
    best: Snapshot | None = None
    for node in path:
        seg = node.value
        if seg is None or node.start >= limit:
            break
        for length, snap in seg.snapshots.items():
            if length <= limit and (best is None or length > best.length):
                best = snap
    return (best.length, best) if best is not None else (0, None)


def _active_adapters(model: Any) -> tuple[str, ...] | None:
    if not getattr(model, "peft_config", None):
        return None
    try:
        return tuple(model.active_adapters())
    except (AttributeError, ValueError):
        return tuple(sorted(model.peft_config))


def _check_manual_media(profile: ModelProfile, tokens: Sequence[int]) -> None:
    """`lookup`/`insert` key token ids only: refuse what only `generate` keys exactly (media, M-RoPE, prefix-LM)."""
    problem = profile.media.manual_problem(tokens) if profile.media is not None else None
    if problem is not None:
        raise ValueError(
            f"lookup()/insert() key token ids only and cannot serve this {problem} request exactly; "
            "use model.generate(**inputs, past_key_values=store), which keys media by content"
        )


def _as_token_list(ids: torch.Tensor | Sequence[int]) -> list[int]:
    if isinstance(ids, torch.Tensor):
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise ValueError(f"expected one sequence, got a batch of {ids.shape[0]}; look up rows one at a time")
            ids = ids[0]
        if ids.dim() != 1:
            raise ValueError(f"expected token ids of shape [L] or [1, L], got {tuple(ids.shape)}")
        return [int(t) for t in ids.tolist()]
    return [int(t) for t in ids]
