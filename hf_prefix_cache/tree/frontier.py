"""Frontier: per tier, the nodes that can leave it now, least valuable first.

A node is on its tier's frontier when it is unlocked and no child sits on the same or a faster
tier: it can leave the tier without stranding a faster descendant. Candidates are kept in one
heap per tier by score; entries go stale instead of being removed (the node was used, moved,
detached, locked or gained a child) and are checked when popped, so keeping the order costs
O(log n) per change. Pure Python, no torch.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from hf_prefix_cache.tree.node import Node

N = TypeVar("N", bound="Node[Any]")
N_co = TypeVar("N_co", bound="Node[Any]", covariant=True)


def can_leave(node: Node[Any]) -> bool:
    """Whether `node` is on its tier's frontier: unlocked, not a root, no child on the same or a faster tier.

    >>> from hf_prefix_cache.tree.node import Node
    >>> can_leave(Node("ns", Node("ns", None, (), 0), (1,), 0))
    True
    """
    if node.lock_ref or node.parent is None:
        return False
    tier = node.tier
    for child in node.children.values():  # noqa: SIM110 (a loop: no generator frame per call on the hot path)
        if child.tier <= tier:
            return False
    return True


class Nodes(Protocol[N_co]):
    """What the frontier reads of its tree, to rebuild a heap grown stale."""

    num_nodes: int

    def iter_nodes(self) -> Iterator[N_co]: ...


class Frontier(Generic[N]):
    """Frontier candidates of `num_tiers` tiers over the nodes of `tree`.

    Example:
        >>> from types import SimpleNamespace
        >>> from hf_prefix_cache.tree.node import Node
        >>> root = Node("ns", None, (), 0)
        >>> leaf = Node("ns", root, (1,), 0)
        >>> frontier = Frontier(1, SimpleNamespace(num_nodes=1, iter_nodes=lambda: iter([leaf])))
        >>> frontier.offer_all([leaf])
        >>> frontier.pop(0) is leaf, frontier.pop(0)
        (True, None)
    """

    def __init__(self, num_tiers: int, tree: Nodes[N]) -> None:
        self._heaps: list[list[tuple[float, int, N]]] = [[] for _ in range(num_tiers)]
        self._seq = itertools.count()
        self._tree = tree

    def offer_all(self, nodes: Iterable[N]) -> None:
        """Make each of `nodes` a candidate of its tier if it is one now: one call for a whole path.

        `can_leave` and the push are written out here: this runs on every insert, touch and
        unlock, and a call per node would cost more than the test itself.
        """
        limit = 2 * self._tree.num_nodes + 1024  # more entries than this: mostly stale, rebuild
        for node in nodes:
            if node.lock_ref or node.parent is None:
                continue
            tier = node.tier
            for child in node.children.values():
                if child.tier <= tier:
                    break
            else:
                heap = self._heaps[tier]
                heapq.heappush(heap, (node.score, next(self._seq), node))
                if len(heap) > limit:
                    self._rebuild(tier)

    def _rebuild(self, tier: int) -> None:
        """Replace `tier`'s heap, grown stale, by one entry per node that can leave the tier now."""
        fresh = [(n.score, next(self._seq), n) for n in self._tree.iter_nodes() if n.tier == tier]
        heap = self._heaps[tier]
        heap[:] = [e for e in fresh if can_leave(e[2])]
        heapq.heapify(heap)

    def pop(self, tier: int, leaves_only: bool = False) -> N | None:
        """The least valuable frontier node of `tier`, or None; with `leaves_only`, one without children.

        The node stays in the tree; one not taken must be offered again. Frontier nodes skipped
        for having children stay candidates.
        """
        heap = self._heaps[tier]
        skipped: list[tuple[float, int, N]] = []
        found: N | None = None
        while heap:
            entry = heapq.heappop(heap)
            node = entry[2]
            if node.score != entry[0] or node.tier != tier or not can_leave(node):
                continue  # stale: used, moved, detached, locked or gained a child since it was offered
            if leaves_only and node.children:
                skipped.append(entry)
                continue
            found = node
            break
        for entry in skipped:
            heapq.heappush(heap, entry)
        return found

    def clear(self) -> None:
        """Forget every candidate."""
        for heap in self._heaps:
            heap.clear()

    def offered(self) -> set[tuple[int, float]]:
        """`(id(node), score)` of every candidate entry, stale ones included (for integrity checks)."""
        return {(id(e[2]), e[0]) for heap in self._heaps for e in heap}
