"""Node: one edge of the radix tree, and what a match or an insert answers.

A node's value is opaque to the tree: it is only asked for its `nbytes` and to `split` itself
when its edge splits (`NodeValue`). Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

from hf_prefix_cache.token_ids import TokenIds


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


ScoreFn = Callable[["Node[Any]", int], float]


def lru_score(node: Node[Any], now: int) -> float:
    """Least recently used first: the score is the clock of the node's last use."""
    return float(now)


def common_len(key: tuple[Hashable, ...], symbols: Sequence[Hashable], pos: int) -> int:
    """Number of leading symbols of `key` equal to `symbols[pos:]`.

    >>> common_len((1, 2, 3), [0, 1, 2, 9], 1)
    2
    """
    n = min(len(key), len(symbols) - pos)
    # Slice comparisons run in C: find the first differing block of 64, then scan inside it.
    if tuple(symbols[pos : pos + n]) == key[:n]:
        return n
    i = 0
    while i + 64 <= n and tuple(symbols[pos + i : pos + i + 64]) == key[i : i + 64]:
        i += 64
    while i < n and key[i] == symbols[pos + i]:
        i += 1
    return i


def node_common_len(node: Node[Any], symbols: Sequence[Hashable], pos: int) -> int:
    """`common_len` of `node`'s key, on int64 bytes when both the node and `symbols` have them."""
    if node.packed is not None and isinstance(symbols, TokenIds):
        return packed_common_len(node.packed, symbols.packed, pos, min(len(node.key), len(symbols) - pos))
    return common_len(node.key, symbols, pos)


def packed_common_len(key: bytes, query: bytes, pos: int, n: int) -> int:
    """`common_len` on int64 bytes: one comparison of the whole span, then halving the span that differs.

    >>> from array import array
    >>> packed_common_len(array("q", [1, 2, 3]).tobytes(), array("q", [0, 1, 2, 9]).tobytes(), 1, 3)
    2
    """
    if key[: 8 * n] == query[8 * pos : 8 * (pos + n)]:
        return n
    lo, hi = 0, n  # ids [0, lo) are equal; one in [lo, hi) differs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if key[8 * lo : 8 * mid] == query[8 * (pos + lo) : 8 * (pos + mid)]:
            lo = mid
        else:
            hi = mid
    return lo
