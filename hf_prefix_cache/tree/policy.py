"""Eviction policies: which stored node leaves its tier first.

A policy gives every node a score each time it is used; the tree hands out the lowest score
first (see `RadixTree.pop_victim`). Two policies:

- `"lru"`: the score is the use clock, so the least recently used node leaves first.
- `"cost"`: GreedyDual-Size-Frequency style. The score is `inflation + saved / nbytes`, where
  `saved` is the prefill work the node spares (tokens it lets the model skip times the layers
  that would recompute them) and `inflation` rises to the score of each node that leaves. Cheap
  nodes that save much stay; big nodes that save little leave first, and old nodes age out as
  inflation passes them. For recurrent models a node's snapshot spares the whole span back to
  the previous snapshot on its path, since nothing shorter can rebuild that state, so such
  nodes weigh far more than plain key/value nodes of the same size.

Knows tree nodes' positions and sizes; nothing about tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hf_prefix_cache.tree.node import Node

POLICIES = ("lru", "cost")

ScoreFn = Callable[["Node[Any]", int], float]


def lru_score(node: Node[Any], now: int) -> float:
    """Least recently used first: the score is the clock of the node's last use."""
    return float(now)


class LRUPolicy:
    """Least recently used first."""

    name = "lru"

    #: The tree recognises this function and scores a node with its clock without a call.
    score = staticmethod(lru_score)

    def left(self, node: Any) -> None:
        """Called when `node` leaves its tier (nothing to do for LRU)."""


class CostAwarePolicy:
    """Keep what saves the most prefill work per byte (GreedyDual-Size with an aging inflation).

    Args:
        num_layers: layers a prefill runs through (the work one token costs).
    """

    name = "cost"

    def __init__(self, num_layers: int) -> None:
        self.num_layers = max(num_layers, 1)
        self.inflation = 0.0

    def score(self, node: Any, now: int) -> float:
        return float(self.inflation + self.saved(node) / max(int(node.nbytes), 1))

    def saved(self, node: Any) -> float:
        """Layer-tokens of prefill that dropping `node` would make the model redo."""
        value = node.value
        tokens = node.end - node.start
        if value is not None and value.snapshots:
            # Losing this node's last snapshot sends a resume back to the previous snapshot above it.
            tokens = max(value.snapshots) - _previous_snapshot(node)
        return float(tokens * self.num_layers)

    def left(self, node: Any) -> None:
        self.inflation = max(self.inflation, node.score)


def _previous_snapshot(node: Any) -> int:
    walk = node.parent
    while walk is not None and not walk.is_root:
        if walk.value is not None and walk.value.snapshots:
            return max(int(n) for n in walk.value.snapshots)
        walk = walk.parent
    return 0


def make_policy(name: str, num_layers: int) -> LRUPolicy | CostAwarePolicy:
    """The policy called `name` ("lru" or "cost").

    Raises:
        ValueError: for another name.
    """
    if name == "lru":
        return LRUPolicy()
    if name == "cost":
        return CostAwarePolicy(num_layers)
    raise ValueError(f"unknown eviction policy {name!r}; use one of {', '.join(POLICIES)}")
