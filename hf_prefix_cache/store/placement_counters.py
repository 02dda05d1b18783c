"""PlacementCounters: what placing stored entries on tiers did, for `CacheStats`.

Shared by the parts of placement (`placement.py`, `disk_nodes.py`): each counts its own events
here, so the store reads one set of counters.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PlacementCounters:
    """Events since the last reset, plus `num_snapshots`: the snapshots stored now (held, not an event).

    >>> counters = PlacementCounters()
    >>> counters.offloads += 1
    >>> counters.offloads, counters.evictions
    (1, 0)
    """

    evictions: int = 0
    evicted_bytes: int = 0
    offloads: int = 0
    reloads: int = 0
    disk_writes: int = 0
    skipped_files: int = 0
    num_snapshots: int = 0
    failed_moves: int = 0

    def reset(self) -> None:
        """Zero the events `CacheStats` reports (`num_snapshots`, what is held, and `disk_writes` stay)."""
        self.evictions = self.evicted_bytes = self.offloads = self.reloads = 0
        self.skipped_files = self.failed_moves = 0
