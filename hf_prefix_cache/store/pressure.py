"""Memory-pressure notifications: tell an app when a tier's use crosses a threshold of its budget.

Knows byte totals and budgets; nothing about what is stored.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PressureEvent:
    """A tier's use rose past `threshold` (a fraction of its budget)."""

    tier: str
    nbytes: int
    max_bytes: int
    threshold: float

    @property
    def fraction(self) -> float:
        return self.nbytes / self.max_bytes if self.max_bytes else 0.0


PressureCallback = Callable[[PressureEvent], None]


class PressureMonitor:
    """Fires each callback once per upward crossing of each of its thresholds, per tier.

    A threshold fires again only after use has fallen back below it.
    """

    def __init__(self) -> None:
        self._watchers: list[tuple[PressureCallback, tuple[float, ...], dict[str, float]]] = []

    def add(self, callback: PressureCallback, thresholds: Sequence[float]) -> None:
        levels = tuple(sorted(float(t) for t in thresholds))
        if not levels or any(not 0.0 < t <= 1.0 for t in levels):
            raise ValueError(f"thresholds are fractions of a budget in (0, 1], got {list(thresholds)}")
        self._watchers.append((callback, levels, {}))

    def check(
        self, tiers: Sequence[str], nbytes: Sequence[int], budgets: Sequence[int]
    ) -> list[tuple[PressureCallback, PressureEvent]]:
        """The calls to make now (the caller makes them outside its lock)."""
        calls: list[tuple[PressureCallback, PressureEvent]] = []
        for callback, levels, reached in self._watchers:
            for tier, used, budget in zip(tiers, nbytes, budgets, strict=True):
                if budget <= 0:
                    continue
                fraction = used / budget
                crossed = [t for t in levels if fraction >= t]
                top = crossed[-1] if crossed else 0.0
                if top > reached.get(tier, 0.0):
                    calls.append((callback, PressureEvent(tier, used, budget, top)))
                reached[tier] = top
        return calls
