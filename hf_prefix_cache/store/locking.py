"""StoreLock: the one owner of a store's lock, which runs the work kept out of it when the lock is let go.

Every mutation of a store's tree happens under the lock. Work that may block or call back into
an app (disk file deletions, remote writes, memory-pressure callbacks) must not run under it;
the owner runs it once the lock is released. Two forms:

- ``with lock():`` (or ``lock(pressure=True)``) for every verb off the hot path: blocks may nest,
  and on leaving the outermost one the tier sizes are checked against the pressure thresholds
  (with ``pressure=True``, still under the lock) and the work kept out runs after it.
- The hot path (`prefixes.py`: one block per step that must hold it) holds ``lock.raw`` and makes
  the same two steps itself, `check_pressure` before letting go and `after_unlock` after, only when
  the store is not `quiet`. A store with no disk or remote tier and no pressure callback is quiet:
  a hit then makes no call here at all.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from hf_prefix_cache.storage.tiers import TIER_NAMES
from hf_prefix_cache.store.placement import Placement
from hf_prefix_cache.store.pressure import PressureCallback, PressureMonitor
from hf_prefix_cache.tree.radix import RadixTree

logger = logging.getLogger("hf_prefix_cache")


class StoreLock:
    """A re-entrant lock plus what runs after it: `with lock():` (or `lock(pressure=True)`).

    Attributes:
        raw: the lock itself (the counters, which only count, and the hot path take it directly).
        quiet: no work can be due after the lock: no disk or remote tier, no pressure callback.
    """

    def __init__(self, tree: RadixTree[Any], placement: Placement, pressure: PressureMonitor) -> None:
        self.raw = threading.RLock()
        self._tree = tree
        self._placement = placement
        self._pressure = pressure
        self._depth = 0  # `with lock():` blocks entered by the thread holding the lock
        self._calls: list[Any] = []  # pressure callbacks due once the lock is let go
        # Tiers that leave work for after the lock (`Tier.flush`): the disk tier's deletions, the remote tier's writes.
        self._flushed = [tier for tier in (placement.disk, placement.remote) if tier is not None]
        self.quiet = not self._flushed

    @contextmanager
    def __call__(self, *, pressure: bool = False) -> Iterator[None]:
        with self.raw:
            self._depth += 1
            try:
                yield
                if pressure:
                    self.check_pressure()
            finally:
                self._depth -= 1
            if self._depth:
                return  # an inner block: the outermost one runs the work
        self.after_unlock()

    def watch(self, callback: PressureCallback, thresholds: Sequence[float]) -> None:
        """Call `callback(event)` when a tier's use rises past a fraction of its budget (`PressureMonitor.add`)."""
        with self.raw:
            self._pressure.add(callback, thresholds)
            self.quiet = False

    def check_pressure(self) -> None:
        """Queue the pressure callbacks the tier sizes call for now (under the lock; they run in `after_unlock`)."""
        self._calls += self._pressure.check(TIER_NAMES, self._tree.tier_nbytes, self._placement.budgets)

    def after_unlock(self) -> None:
        """File deletions, remote writes and queued pressure callbacks, outside the lock."""
        for tier in self._flushed:
            tier.flush()
        if not self._calls:
            return
        with self.raw:
            calls, self._calls = self._calls, []
        for callback, event in calls:
            try:
                callback(event)
            except Exception:  # an app's callback must not break generation
                logger.exception("memory-pressure callback failed")
