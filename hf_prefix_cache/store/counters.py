"""RequestCounters: what the store counts per request, the callbacks told about each one, and logging once.

Served requests, cold runs (`fallbacks`, by reason), requests served with less reuse than
they could have had (also under `fallbacks`, by reason), hits per modality and the prefill
spared. `record` is the contract's verb (`contract.Store.record`): a hook tells the store
what happened to a request, and the store hands it here. Every count happens under the store's
lock; callbacks run after it, outside.

What can be derived from the sums is derived when the stats are read, not per request: the
prefill spared (from the hit tokens and the sum of their attention pairs) and the text share of
the hits of requests without media symbols.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hf_prefix_cache.store.contract import Event, Fallback, FallbackRan, NotStored, Served
from hf_prefix_cache.store.observe import TEXT, PrefillCost, RequestCallback, RequestEvent, hit_tokens_by_modality
from hf_prefix_cache.store.scope import ACTIVE_SCOPES, RequestScope, scopes_of

logger = logging.getLogger("hf_prefix_cache")


@dataclass(slots=True)
class Counts:
    """The request counters `CacheStats` reports, and the sums two of them are derived from."""

    requests: int = 0
    hit_requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    computed_tokens: int = 0
    expired: int = 0
    fallbacks: Counter[str] = field(default_factory=Counter)
    media_hit_by_modality: Counter[str] = field(default_factory=Counter)  # requests that gave their symbols
    text_only_hit_tokens: int = 0  # hit tokens of requests without symbols (all text)
    hit_pairs: int = 0  # sum over restored rows of r * (r + 1) / 2: the (query, key) pairs they spared


class RequestCounters:
    """Counts requests into `counts`, under `lock`, and tells the `on_request` callbacks about each."""

    def __init__(self, lock: threading.RLock, prefill_cost: PrefillCost) -> None:
        self._lock = lock
        self._prefill_cost = prefill_cost
        self.counts = Counts()
        self._callbacks: list[RequestCallback] = []
        self._logged: set[str] = set()

    def scope(self, salt: str | None = None) -> RequestScope:
        """A request scope of this store (`PrefixCache.request`): the calls it is active around count into it."""
        return RequestScope(self, salt)

    def add_callback(self, callback: RequestCallback) -> None:
        with self._lock:
            self._callbacks.append(callback)

    def reset(self) -> None:
        with self._lock:
            self.counts = Counts()

    def record(self, event: Event) -> None:
        """Count what happened to a request (see `contract.Event`); a cold run is logged once per reason at WARNING."""
        if isinstance(event, Served):
            self._served(event)
        elif isinstance(event, Fallback):
            self.cold(event.reason, event.prompt_len)
            if event.log:
                self.log_fallback(event.reason)
        elif isinstance(event, FallbackRan):
            self.log_fallback(event.reason, event.detail)
        elif isinstance(event, NotStored):
            self.event(event.reason)
            self.log_once(
                event.reason, "prefix cache: not storing a served request (%s): %s", event.reason, event.detail
            )
        else:
            self.event(event.reason)

    def _served(self, served: Served) -> None:
        """Count a served request; its `symbols` (the prompt's tree symbols) split its hits by modality.

        A batch whose rows restored prefixes of their own (`Served.rows`) is counted by its rows' sums,
        and reaches callbacks as one row of those totals.
        """
        prompt_len, restore_len, num_rows, symbols, rows = served
        if rows:
            prompt_len, restore_len, num_rows = sum(p for p, _ in rows), sum(r for _, r in rows), 1
            pairs = sum(r * (r + 1) // 2 for _, r in rows if r > 0)
        else:
            pairs = restore_len * (restore_len + 1) // 2 * num_rows if restore_len > 0 else 0
        by_modality = hit_tokens_by_modality(symbols, restore_len, num_rows) if symbols is not None else None
        with self._lock:
            c = self.counts
            c.requests += 1
            c.prompt_tokens += prompt_len * num_rows
            c.hit_tokens += restore_len * num_rows
            c.computed_tokens += (prompt_len - restore_len) * num_rows
            c.hit_requests += restore_len > 0  # with rows: any row
            c.hit_pairs += pairs
            if by_modality is None:
                c.text_only_hit_tokens += max(restore_len, 0) * num_rows
            else:
                c.media_hit_by_modality.update(by_modality)
            callbacks = list(self._callbacks) if self._callbacks else None
        active = ACTIVE_SCOPES.get()
        scopes = scopes_of(self, active) if active else ()
        if not (callbacks or scopes):
            return
        if by_modality is None:
            by_modality = hit_tokens_by_modality(None, restore_len, num_rows)
        for scope in scopes:
            scope.count_served(prompt_len * num_rows, restore_len * num_rows, by_modality)
        if callbacks:
            # Without the cache, positions [0, restore_len) would have been prefilled too.
            if rows:
                saved = sum(self._prefill_cost.flops(0, r) for _, r in rows)
            else:
                saved = self._prefill_cost.flops(0, restore_len) * num_rows
            _notify(callbacks, RequestEvent(prompt_len, restore_len, num_rows, by_modality, saved))

    def cold(self, reason: str, prompt_len: int) -> None:
        """Count a request run cold for `reason`."""
        with self._lock:
            c = self.counts
            c.requests += 1
            c.prompt_tokens += prompt_len
            c.computed_tokens += prompt_len
            c.fallbacks[reason] += 1
            callbacks = list(self._callbacks)
        active = ACTIVE_SCOPES.get()
        for scope in scopes_of(self, active) if active else ():
            scope.count_cold(reason, prompt_len)
        if callbacks:
            _notify(callbacks, RequestEvent(prompt_len, 0, fallback=reason))

    def event(self, reason: str) -> None:
        """Count `reason` in `fallbacks` without a request (less reuse, a skipped insert)."""
        with self._lock:
            self.counts.fallbacks[reason] += 1
        active = ACTIVE_SCOPES.get()
        for scope in scopes_of(self, active) if active else ():
            scope.count_reason(reason)

    def expired(self, num_entries: int) -> None:
        self.counts.expired += num_entries

    def hit_by_modality(self) -> dict[str, int]:
        """`hit_tokens` split by what the restored positions held (read under the lock)."""
        c = self.counts
        by_modality = dict(c.media_hit_by_modality)
        if c.text_only_hit_tokens:
            by_modality[TEXT] = by_modality.get(TEXT, 0) + c.text_only_hit_tokens
        return by_modality

    def saved_prefill_flops(self) -> int:
        """The estimated prefill FLOPs every hit so far spared (read under the lock; see `observe.PrefillCost`)."""
        return self._prefill_cost.flops_of(self.counts.hit_tokens, self.counts.hit_pairs)

    def log_fallback(self, reason: str, detail: str = "") -> None:
        """Log a cold run (and `detail`, what a failed check found): a WARNING the first time a reason occurs in
        this store, DEBUG after."""
        if detail:
            self.log_once(reason, "prefix cache skipped, running cold: %s (%s)", reason, detail)
        else:
            self.log_once(reason, "prefix cache skipped, running cold: %s", reason)

    def log_once(self, kind: str, message: str, *args: Any) -> None:
        """Log a WARNING the first time `kind` happens in this store, DEBUG after that."""
        with self._lock:
            first = kind not in self._logged
            self._logged.add(kind)
        logger.log(logging.WARNING if first else logging.DEBUG, message, *args)


def _notify(callbacks: Sequence[RequestCallback], event: RequestEvent) -> None:
    for callback in callbacks:
        try:
            callback(event)
        except Exception:  # an exporter must not break generation
            logger.exception("on_request callback failed")
