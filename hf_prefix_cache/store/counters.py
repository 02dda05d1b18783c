"""RequestCounters: what the store counts per request, the callbacks told about each one, and logging once.

Served requests, cold runs (`fallbacks`, by reason), requests served with less reuse than
they could have had (also under `fallbacks`, by reason), hits per modality and the prefill
spared. Every count happens under the store's lock; callbacks run after it, outside.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hf_prefix_cache.store.observe import PrefillCost, RequestCallback, RequestEvent, hit_tokens_by_modality

if TYPE_CHECKING:
    from hf_prefix_cache.store.contract import Served

logger = logging.getLogger("hf_prefix_cache")


@dataclass(slots=True)
class Counts:
    """The request counters `CacheStats` reports."""

    requests: int = 0
    hit_requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    computed_tokens: int = 0
    expired: int = 0
    fallbacks: Counter[str] = field(default_factory=Counter)
    hit_by_modality: Counter[str] = field(default_factory=Counter)
    saved_prefill_flops: int = 0


class RequestCounters:
    """Counts requests into `counts`, under `lock`, and tells the `on_request` callbacks about each."""

    def __init__(self, lock: threading.RLock, prefill_cost: PrefillCost) -> None:
        self._lock = lock
        self._prefill_cost = prefill_cost
        self.counts = Counts()
        self._callbacks: list[RequestCallback] = []
        self._logged: set[str] = set()

    def add_callback(self, callback: RequestCallback) -> None:
        with self._lock:
            self._callbacks.append(callback)

    def reset(self) -> None:
        with self._lock:
            self.counts = Counts()

    def served(self, served: Served) -> None:
        """Count a served request; its `symbols` (the prompt's tree symbols) split its hits by modality.

        A batch whose rows restored prefixes of their own (`Served.rows`) is counted by its rows' sums,
        and reaches callbacks as one row of those totals.
        """
        prompt_len, restore_len, num_rows, symbols, rows = served
        if rows:
            prompt_len, restore_len, num_rows = sum(p for p, _ in rows), sum(r for _, r in rows), 1
        by_modality = hit_tokens_by_modality(symbols, restore_len, num_rows)
        # Without the cache, positions [0, restore_len) would have been prefilled too.
        if rows:
            saved = sum(self._prefill_cost.flops(0, r) for _, r in rows)
        else:
            saved = self._prefill_cost.flops(0, restore_len) * num_rows
        with self._lock:
            c = self.counts
            c.requests += 1
            c.prompt_tokens += prompt_len * num_rows
            c.hit_tokens += restore_len * num_rows
            c.computed_tokens += (prompt_len - restore_len) * num_rows
            c.hit_requests += restore_len > 0  # with rows: any row
            c.hit_by_modality.update(by_modality)
            c.saved_prefill_flops += saved
            callbacks = list(self._callbacks)
        if callbacks:
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
        if callbacks:
            _notify(callbacks, RequestEvent(prompt_len, 0, fallback=reason))

    def event(self, reason: str) -> None:
        """Count `reason` in `fallbacks` without a request (less reuse, a skipped insert)."""
        with self._lock:
            self.counts.fallbacks[reason] += 1

    def expired(self, num_entries: int) -> None:
        self.counts.expired += num_entries

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
