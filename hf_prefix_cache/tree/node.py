"""Node: one edge of the radix tree, the tree's answers (`MatchResult`, `InsertResult`) and its frontier.

A node holds its symbols, its place (namespace, start), its children keyed by their first
symbol, its opaque value (`NodeValue`: asked only for `nbytes` and to `split`), its tier, pins
and eviction score. `radix.RadixTree` owns every change to them; other modules only read them.

The frontier (`Frontier`) is the nodes' eviction order, read from those fields alone: per tier,
the nodes that can leave it now, least valuable first. A node is on its tier's frontier when it
is unlocked and no child sits on the same or a faster tier (`can_leave`): it can leave the tier
without stranding a faster descendant. Candidates are kept in one heap per tier by score; entries
go stale instead of being removed (the node was used, moved, detached, locked or gained a child)
and are checked when popped, so keeping the order costs O(log n) per change. The tree offers
the frontier a whole path at once on every hit, so it lives here, beside the nodes it reads,
not in a module of its own. Pure Python, no torch.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterable, Iterator
from typing import Any, Generic, NamedTuple, Protocol, TypeVar


class NodeValue(Protocol):
    """What the tree needs from a stored value."""

    @property
    def nbytes(self) -> int: ...

    def split(self, offset: int) -> tuple[NodeValue, NodeValue]:
        """Return the values of the head `[0, offset)` and the tail `[offset, len)` of this edge."""
        ...


V = TypeVar("V", bound=NodeValue)


class Node(Generic[V]):
    """One edge of the tree: the symbols `key` covering positions `[start, start + len(key))`.

    >>> node = Node("ns", None, (1, 2, 3), 4)
    >>> node.end, node.is_root
    (7, True)
    """

    __slots__ = (
        "children",
        "key",
        "last_access",
        "lock_ref",
        "namespace",
        "nbytes",
        "packed",
        "parent",
        "score",
        "start",
        "tier",
        "used_at",
        "value",
    )

    def __init__(self, namespace: Hashable, parent: Node[V] | None, key: tuple[Hashable, ...], start: int) -> None:
        self.namespace = namespace
        self.parent = parent
        self.key = key
        self.packed: bytes | None = None  # the key as int64 bytes, when it was inserted from `TokenIds`
        self.start = start
        self.children: dict[Hashable, Node[V]] = {}
        self.value: V | None = None
        self.nbytes = 0
        self.lock_ref = 0
        self.last_access = 0
        self.score = 0.0
        self.tier = 0
        self.used_at = 0.0  # time.monotonic() of the last use, for expiry

    @property
    def end(self) -> int:
        return self.start + len(self.key)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __repr__(self) -> str:
        return f"Node([{self.start}, {self.end}), children={len(self.children)}, lock_ref={self.lock_ref})"


class MatchResult(NamedTuple):
    """The longest stored prefix of a query.

    `path` holds the nodes from the root's child down to the last node that matched at least
    one symbol; the last one may match only partly (its `start < matched_len < end`).
    """

    matched_len: int
    path: tuple[Node[Any], ...]


class InsertResult(NamedTuple):
    """What an insert found and added: `path` covers the whole inserted sequence."""

    matched_len: int
    path: tuple[Node[Any], ...]
    new_node: Node[Any] | None


N = TypeVar("N", bound="Node[Any]")
N_co = TypeVar("N_co", bound="Node[Any]", covariant=True)


def can_leave(node: Node[Any]) -> bool:
    """Whether `node` is on its tier's frontier: unlocked, not a root, no child on the same or a faster tier.

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
