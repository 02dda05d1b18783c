"""Node: one edge of the radix tree, and what a match or an insert answers.

A node's value is opaque to the tree: it is only asked for its `nbytes` and to `split` itself
when its edge splits (`NodeValue`). Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, Generic, NamedTuple, Protocol, SupportsIndex, TypeVar, overload


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


class TokenIds(tuple[int, ...]):
    """Token ids that carry their bytes as int64 (native order): the tree compares them at C speed.

    Made by the hooks from the same host copy of the ids as the ints themselves, so the two
    always agree. A slice keeps its bytes. A node inserted from a `TokenIds` query keeps its
    key's bytes beside the key (`Node.packed`, checked against the key by `checks.py`), so
    comparing a stored key with a query costs a `memcmp` instead of a Python comparison per token.
    It is immutable, so ids and bytes cannot drift apart, and it compares equal to a list of the
    same ids, as the lists of ids it stands in for did.

    >>> from array import array
    >>> ids = TokenIds([5, 6, 7], array("q", [5, 6, 7]).tobytes())
    >>> ids[1:] == [6, 7], ids[1:].packed == array("q", [6, 7]).tobytes()
    (True, True)
    """

    packed: bytes

    def __new__(cls, ids: Iterable[int], packed: bytes) -> TokenIds:
        self = super().__new__(cls, ids)
        assert len(packed) == 8 * len(self), f"{len(packed)} bytes for {len(self)} token ids"
        self.packed = packed
        return self

    @overload
    def __getitem__(self, index: SupportsIndex) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...

    def __getitem__(self, index: SupportsIndex | slice) -> int | tuple[int, ...]:
        if not isinstance(index, slice):
            return tuple.__getitem__(self, index)
        start, stop, step = index.indices(len(self))
        if step != 1:
            return tuple.__getitem__(self, index)
        if start == 0 and stop >= len(self):
            return self
        stop = max(start, stop)
        return TokenIds(tuple.__getitem__(self, index), self.packed[8 * start : 8 * stop])

    def __eq__(self, other: object) -> bool:
        return tuple.__eq__(self, tuple(other) if isinstance(other, list) else other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = tuple.__hash__


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
        return _common_packed(node.packed, symbols.packed, pos, min(len(node.key), len(symbols) - pos))
    return common_len(node.key, symbols, pos)


def _common_packed(key: bytes, query: bytes, pos: int, n: int) -> int:
    """`common_len` on int64 bytes: one comparison of the whole span, then halving the span that differs.

    >>> from array import array
    >>> _common_packed(array("q", [1, 2, 3]).tobytes(), array("q", [0, 1, 2, 9]).tobytes(), 1, 3)
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
