"""StoreLock: the one owner of a store's lock, which runs the work kept out of it when the lock is let go.

Every mutation of a store's tree happens inside ``with lock():``. Work that may block or call
back into an app (disk file deletions, remote writes, memory-pressure callbacks) must not run
under the lock; the owner runs it on leaving the outermost block, once the lock is released.
With ``lock(pressure=True)`` the tier sizes are checked against the pressure thresholds first
(still under the lock) and the callbacks that fire are made after it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hf_prefix_cache.storage.tiers import TIER_NAMES
from hf_prefix_cache.store.placement import Placement
from hf_prefix_cache.store.pressure import PressureMonitor
from hf_prefix_cache.tree.radix import RadixTree

logger = logging.getLogger("hf_prefix_cache")


class StoreLock:
    """A re-entrant lock plus what runs after it: `with lock():` (or `lock(pressure=True)`)."""

    def __init__(self, tree: RadixTree[Any], placement: Placement, pressure: PressureMonitor) -> None:
        self.raw = threading.RLock()  # for the counters, which only count
        self._tree = tree
        self._placement = placement
        self._pressure = pressure
        self._depth = 0  # blocks entered by the thread holding the lock
        self._calls: list[Any] = []  # pressure callbacks due once the outermost block is left

    @contextmanager
    def __call__(self, *, pressure: bool = False) -> Iterator[None]:
        with self.raw:
            self._depth += 1
            try:
                yield
                if pressure:
                    self._calls += self._pressure.check(TIER_NAMES, self._tree.tier_nbytes, self._placement.budgets)
            finally:
                self._depth -= 1
            if self._depth:
                return  # an inner block: the outermost one runs the work
            calls, self._calls = self._calls, []
        self._after_unlock(calls)

    def _after_unlock(self, calls: list[Any]) -> None:
        """File deletions, remote writes and pressure callbacks, outside the lock."""
        if self._placement.disk is not None:
            self._placement.disk.empty_trash()
        if self._placement.remote is not None:
            self._placement.remote.flush()
        for callback, event in calls:
            try:
                callback(event)
            except Exception:  # an app's callback must not break generation
                logger.exception("memory-pressure callback failed")
