"""RadixTree: longest-prefix match, insert, lock and LRU eviction over symbol sequences.

Owns the tree shape and the LRU order. Knows nothing about torch or models: a node's
value is opaque, only asked for its `nbytes` and to `split` itself when an edge splits.
Symbols are any hashable values compared by equality (token ids, media symbols).

Each namespace has its own root, so entries of different namespaces never share nodes,
while eviction still orders all of them by one clock.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator, Sequence
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
    """One edge of the tree: the symbols `key` covering positions `[start, start + len(key))`."""

    __slots__ = ("children", "key", "last_access", "lock_ref", "namespace", "nbytes", "parent", "start", "value")

    def __init__(self, namespace: Hashable, parent: Node[V] | None, key: tuple[Hashable, ...], start: int) -> None:
        self.namespace = namespace
        self.parent = parent
        self.key = key
        self.start = start
        self.children: dict[Hashable, Node[V]] = {}
        self.value: V | None = None
        self.nbytes = 0
        self.lock_ref = 0
        self.last_access = 0

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


class RadixTree(Generic[V]):
    """A radix tree of symbol sequences with pinned nodes and LRU eviction of leaves.

    Not thread-safe: the owner serialises calls.

    Example:
        >>> class Blob(bytes):
        ...     nbytes = property(len)
        ...     def split(self, k): return Blob(self[:k]), Blob(self[k:])
        >>> tree = RadixTree()
        >>> _ = tree.insert("ns", [1, 2, 3, 4], lambda a, b: Blob(b"x" * (b - a)))
        >>> tree.match("ns", [1, 2, 9]).matched_len
        2
    """

    def __init__(self) -> None:
        self._roots: dict[Hashable, Node[V]] = {}
        self._clock = itertools.count(1)
        # Eviction candidates, (last_access, id, node); entries go stale instead of being removed
        # and are checked when popped, so keeping LRU order costs O(log n) per change.
        self._candidates: list[tuple[int, int, Node[V]]] = []
        self.total_nbytes = 0
        self.num_nodes = 0
        self.num_leaves = 0

    # ----------------------------------------------------------------- queries
    def match(self, namespace: Hashable, symbols: Sequence[Hashable]) -> MatchResult:
        """Find the longest stored prefix of `symbols` in `namespace`.

        Time is proportional to `len(symbols)`, not to the number of stored entries.
        Does not change the LRU order; call `touch` or `lock` for that.
        """
        root = self._roots.get(namespace)
        if root is None:
            return MatchResult(0, ())
        path: list[Node[V]] = []
        node, pos, n = root, 0, len(symbols)
        while pos < n:
            child = node.children.get(symbols[pos])
            if child is None:
                break
            common = _common_len(child.key, symbols, pos)
            path.append(child)
            pos += common
            if common < len(child.key):
                break
            node = child
        return MatchResult(pos, tuple(path))

    def iter_nodes(self) -> Iterator[Node[V]]:
        """All non-root nodes, parents before children."""
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if not node.is_root:
                yield node
            stack.extend(node.children.values())

    def namespaces(self) -> list[Hashable]:
        return list(self._roots)

    # ---------------------------------------------------------------- mutation
    def insert(
        self,
        namespace: Hashable,
        symbols: Sequence[Hashable],
        make_value: _ValueFactory[V],
    ) -> InsertResult:
        """Store `symbols`, sharing the longest existing prefix.

        `make_value(start, end)` builds the value of the new leaf covering `[start, end)`; it is
        called at most once, and not at all when `symbols` is already stored. An edge that the
        new sequence leaves in its middle is split, with its value split alongside.
        """
        if not symbols:
            return InsertResult(0, (), None)
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = Node(namespace, None, (), 0)
        path: list[Node[V]] = []
        node, pos, n = root, 0, len(symbols)
        now = next(self._clock)
        while pos < n:
            child = node.children.get(symbols[pos])
            if child is None:
                break
            common = _common_len(child.key, symbols, pos)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = now
            path.append(child)
            pos += common
            node = child
        matched_len = pos
        new_node: Node[V] | None = None
        if pos < n:
            new_node = Node(namespace, node, tuple(symbols[pos:]), pos)
            value = make_value(pos, n)
            new_node.value = value
            new_node.nbytes = value.nbytes
            new_node.last_access = now
            if node.children or node.is_root:
                self.num_leaves += 1
            node.children[new_node.key[0]] = new_node
            self.total_nbytes += new_node.nbytes
            self.num_nodes += 1
            path.append(new_node)
        if path:
            self._offer(path[-1])
        return InsertResult(matched_len, tuple(path), new_node)

    def set_value(self, node: Node[V], value: V) -> None:
        """Replace `node`'s value, keeping the byte total exact."""
        self.total_nbytes += value.nbytes - node.nbytes
        node.value = value
        node.nbytes = value.nbytes

    def refresh_nbytes(self, node: Node[V]) -> None:
        """Re-read `node.value.nbytes` after the owner changed the value in place."""
        assert node.value is not None, f"{node} has no value"
        self.set_value(node, node.value)

    def touch(self, path: Sequence[Node[V]]) -> None:
        """Mark `path` as used now (LRU order)."""
        now = next(self._clock)
        for node in path:
            node.last_access = now
        if path:
            self._offer(path[-1])

    def lock(self, node: Node[V]) -> None:
        """Pin `node` and its ancestors: pinned nodes are never evicted. Pair with `unlock(node)`.

        Walking up from the deepest node keeps the count right even if an edge above it is
        split meanwhile (the new head inherits the count).
        """
        now = next(self._clock)
        walk: Node[V] | None = node
        while walk is not None and not walk.is_root:
            walk.lock_ref += 1
            walk.last_access = now
            walk = walk.parent

    def unlock(self, node: Node[V]) -> None:
        walk: Node[V] | None = node
        while walk is not None and not walk.is_root:
            assert walk.lock_ref > 0, f"unlock of an unlocked node {walk}"
            walk.lock_ref -= 1
            if walk.lock_ref == 0:
                self._offer(walk)
            walk = walk.parent

    def evict(self, nbytes_to_free: int) -> list[Node[V]]:
        """Remove least recently used unlocked leaves until `nbytes_to_free` bytes are gone.

        Returns the removed nodes (values still attached) so the owner can release them.
        Frees less when everything left is locked. Evicting 0 bytes is always safe.
        """
        if nbytes_to_free <= 0:
            return []
        heap = self._candidates
        evicted: list[Node[V]] = []
        freed = 0
        while heap and freed < nbytes_to_free:
            last_access, _, node = heapq.heappop(heap)
            if node.last_access != last_access or node.parent is None or not self._is_evictable(node):
                continue  # stale: used, detached, locked or no longer a leaf since it was offered
            freed += node.nbytes
            parent = self._remove_leaf(node)
            evicted.append(node)
            if parent is not None:
                self._offer(parent)
        return evicted

    def remove(self, node: Node[V]) -> list[Node[V]]:
        """Remove `node` and its whole subtree, whatever their locks; returns the removed nodes."""
        # Locks held inside the subtree no longer pin the ancestors.
        walk = node.parent
        while walk is not None and not walk.is_root:
            walk.lock_ref -= node.lock_ref
            walk = walk.parent
        removed = [node]
        stack = list(node.children.values())
        while stack:
            child = stack.pop()
            removed.append(child)
            stack.extend(child.children.values())
        parent = node.parent
        for gone in reversed(removed):
            gone.children.clear()
            self._remove_leaf(gone)
        if parent is not None:
            self._offer(parent)
        return removed

    def clear(self) -> list[Node[V]]:
        """Remove everything; returns the removed nodes."""
        removed = list(self.iter_nodes())
        for node in removed:
            node.parent = None
        self._roots.clear()
        self._candidates.clear()
        self.total_nbytes = 0
        self.num_nodes = 0
        self.num_leaves = 0
        return removed

    def check_integrity(self) -> None:
        """Raise `RuntimeError` naming the totals that disagree."""
        nbytes = 0
        count = 0
        leaves = 0
        for node in self.iter_nodes():
            count += 1
            leaves += not node.children
            nbytes += node.nbytes
            assert node.parent is not None
            if node.start != node.parent.end:
                raise RuntimeError(f"{node} starts at {node.start} but its parent ends at {node.parent.end}")
            if not node.key or node.parent.children.get(node.key[0]) is not node:
                raise RuntimeError(f"{node} is not linked under its first symbol")
            if node.value is None or node.value.nbytes != node.nbytes:
                raise RuntimeError(f"{node} caches nbytes={node.nbytes}, value says otherwise")
            # A node's count includes its children's (locks walk up), so it is at least their sum.
            locked_children = sum(c.lock_ref for c in node.children.values())
            if node.lock_ref < locked_children:
                raise RuntimeError(f"{node} lock_ref={node.lock_ref} below its children's {locked_children}")
        if nbytes != self.total_nbytes:
            raise RuntimeError(f"total_nbytes={self.total_nbytes} but nodes hold {nbytes}")
        if count != self.num_nodes:
            raise RuntimeError(f"num_nodes={self.num_nodes} but the tree has {count}")
        if leaves != self.num_leaves:
            raise RuntimeError(f"num_leaves={self.num_leaves} but the tree has {leaves}")

    # ----------------------------------------------------------------- helpers
    def _is_evictable(self, node: Node[V]) -> bool:
        return not node.children and node.lock_ref == 0 and not node.is_root

    def _offer(self, node: Node[V]) -> None:
        """Make `node` an eviction candidate if it is one now."""
        if self._is_evictable(node):
            heapq.heappush(self._candidates, (node.last_access, id(node), node))
            if len(self._candidates) > 2 * self.num_nodes + 1024:
                self._candidates = [(n.last_access, id(n), n) for n in self.iter_nodes() if self._is_evictable(n)]
                heapq.heapify(self._candidates)

    def _remove_leaf(self, node: Node[V]) -> Node[V] | None:
        parent = node.parent
        assert parent is not None and not node.children, f"{node} is not a leaf"
        del parent.children[node.key[0]]
        node.parent = None
        self.total_nbytes -= node.nbytes
        self.num_nodes -= 1
        if parent.children or parent.is_root:
            self.num_leaves -= 1
        if parent.is_root and not parent.children:
            self._roots.pop(parent.namespace, None)
        return parent

    def _split(self, node: Node[V], offset: int) -> Node[V]:
        """Cut `node` after `offset` symbols; returns the new head, which keeps `node`'s place."""
        assert 0 < offset < len(node.key), f"split at {offset} of an edge of {len(node.key)}"
        assert node.value is not None and node.parent is not None
        old_nbytes = node.nbytes
        head_value, tail_value = node.value.split(offset)
        head: Node[V] = Node(node.namespace, node.parent, node.key[:offset], node.start)
        head.value = head_value  # type: ignore[assignment]
        head.nbytes = head_value.nbytes
        head.lock_ref = node.lock_ref
        head.last_access = node.last_access
        node.parent.children[head.key[0]] = head
        node.parent = head
        node.key = node.key[offset:]
        node.start += offset
        node.value = tail_value  # type: ignore[assignment]
        node.nbytes = tail_value.nbytes
        head.children[node.key[0]] = node
        self.num_nodes += 1
        # A split moves bytes between two nodes; the total changes only if a value's split is lossy.
        self.total_nbytes += head.nbytes + node.nbytes - old_nbytes
        return head


class _ValueFactory(Protocol[V]):  # type: ignore[misc]
    def __call__(self, start: int, end: int) -> V: ...


def _common_len(key: tuple[Hashable, ...], symbols: Sequence[Hashable], pos: int) -> int:
    """Number of leading symbols of `key` equal to `symbols[pos:]`."""
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
