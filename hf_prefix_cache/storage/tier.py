"""Tier: the one protocol every place a stored segment can live speaks (device, host, disk, remote).

A tier keeps copies of segments (`put`), hands back the one it keeps readable in memory (`get`),
gives back what a segment holds on it (`drop`), and finishes outside the store's lock what those
left for later (`flush`: the disk tier's deletions, the remote tier's writes). What a tier may
need to know about where a segment sits among the stored sequences (its namespace, its whole
symbol sequence, the segments before it) it asks of a `Place`, which the store answers from its
tree; the tiers never see it.

Which tier a segment goes to, when and why is the store's placement policy
(`store/placement.py`); a tier only does what it is told, and raises when it cannot (a full or
read-only disk, no host memory): the policy decides what a failure means.

Knows segments; nothing about the tree.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hf_prefix_cache.storage.segments import Segment


class Place(Protocol):
    """Where a segment sits: what a tier may ask when it keeps one."""

    @property
    def namespace(self) -> str:
        """The namespace of the sequence the segment belongs to."""
        ...

    def symbols(self) -> tuple[Hashable, ...]:
        """The whole symbol sequence from position 0 to the segment's end."""
        ...

    def segments(self) -> list[Segment]:
        """The segments of that sequence, first to last (the last is the segment itself)."""
        ...

    def load(self, seg: Segment) -> Segment:
        """`seg`, one of `segments()`, readable in memory (a file's contents loaded; others as they are)."""
        ...


class Tier(Protocol):
    """One place stored segments live: `put` a copy there, `get` it back in memory, `drop` it, `flush` after the lock.

    Every verb raises on failure (out of memory, a full disk, a corrupt file, symbols that
    cannot persist); the caller keeps the segment where it was.
    """

    #: The tier's name, as users see it (`PrefixCache.budgets`, `PressureEvent.tier`).
    name: str

    def put(self, seg: Segment, place: Place) -> Segment | None:
        """A copy of in-memory `seg` kept by this tier (the caller releases the old one).

        Returns the segment the caller now holds for it, or None when the tier keeps it for
        others and the caller holds nothing (a tier shared by processes: the remote server).
        """
        ...

    def get(self, seg: Segment, place: Place) -> Segment:
        """`seg` (one this tier handed out, at `place`) readable in memory: itself, or a copy loaded from where it lies.

        A tier that hands out no segments (the remote server) reads `seg` as the range of `place`'s
        sequence wanted, and returns the longest part of it from its start that it holds (empty
        when none).

        Raises:
            CorruptFileError: what `seg` refers to is missing, unreadable or altered.
            RemoteUnavailableError: the remote server could not be asked (`remote.py`).
        """
        ...

    def drop(self, seg: Segment) -> None:
        """Give back what `seg` holds on this tier (its share of a run, its file); `seg` is not used again."""
        ...

    def flush(self) -> None:
        """Finish what `put` and `drop` left for later (file deletions, writes to a server): the store calls it
        outside its lock. A tier that leaves nothing for later does nothing."""
        ...


class Off:
    """A tier that is switched off (no disk folder): its budget is 0, so nothing is ever put on it.

    >>> Off("disk").name
    'disk'
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def put(self, seg: Segment, place: Place) -> Segment | None:
        raise RuntimeError(f"the {self.name} tier is off")

    def get(self, seg: Segment, place: Place) -> Segment:
        raise RuntimeError(f"the {self.name} tier is off: it holds nothing")

    def drop(self, seg: Segment) -> None:
        raise RuntimeError(f"the {self.name} tier is off: it holds nothing")

    def flush(self) -> None:
        """Nothing was left for later."""


@dataclass(frozen=True, slots=True)
class Standalone:
    """The `Place` of segments that are a whole sequence of their own, not in any tree (examples, tests).

    >>> Standalone("ns", (5, 6, 7)).symbols()
    (5, 6, 7)
    """

    namespace: str
    whole: tuple[Hashable, ...]
    parts: Sequence[Segment] = field(default=())

    def symbols(self) -> tuple[Hashable, ...]:
        return self.whole

    def segments(self) -> list[Segment]:
        return list(self.parts)

    def load(self, seg: Segment) -> Segment:
        assert seg.disk is None, "a standalone place holds segments in memory"
        return seg
