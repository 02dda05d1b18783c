"""Node: one edge of the radix tree, and the tree's answers (`MatchResult`, `InsertResult`).

A node holds its symbols, its place (namespace, start), its children keyed by their first
symbol, its opaque value (`NodeValue`: asked only for `nbytes` and to `split`), its tier, pins
and eviction score. `radix.RadixTree` owns every change to them; other modules only read them.
"""

from __future__ import annotations

from collections.abc import Hashable
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
