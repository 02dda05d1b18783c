"""A medium of the fixtures' pool named by its seed (and kind), for the families whose media are nothing more.

The seed picks the medium's shape from the family's tables (``seed % 3``: seeds 1 and 13 alike, seed 2
another) and seeds its content; a family subclasses `Seeded` (one kind of medium) or `PoolMedium` for what it
derives from them.

Example:
    >>> image = partial(PoolMedium, "image")
    >>> image(13)
    PoolMedium(kind='image', seed=13)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

__all__ = ["PoolMedium", "Seeded", "partial"]


@dataclass(frozen=True)
class Seeded:
    """One medium of a family of one kind: its seed alone."""

    seed: int


@dataclass(frozen=True)
class PoolMedium:
    """One medium of the pool: its kind (``"image"``, ``"video"`` or ``"audio"``) and seed."""

    kind: str
    seed: int
