"""RadixTree: longest-prefix match, insert, lock and eviction order over symbol sequences (nodes, frontier: `node.py`).

Owns the tree shape, the per-tier byte totals and the eviction order. Knows nothing about
torch or models: a node's value is opaque, only asked for its `nbytes` and to `split` itself
when an edge splits (`NodeValue`). Symbols are any hashable values compared by equality (token
ids, media symbols); a `TokenIds` query is compared on its int64 bytes (`compare.py`) and read
through its `memoryview`, so a hit makes no Python int of its ids but the one each child is
found by and the few new ones of the node it inserts.

Each namespace has its own root, so entries of different namespaces never share nodes,
while eviction still orders all of them by one clock.

Tiers: every node sits on a tier (0 = fastest). The owner moves nodes between tiers
(`set_tier`); the tree only keeps byte totals per tier and, per tier, the *frontier*
(`node.Frontier`): the nodes that can leave the tier without stranding a faster descendant, which
`pop_victim` hands out least valuable first. A node's value for eviction is its `score` (lower
leaves first), set by the `score` callable whenever the node is used; the default is its
last-use clock (LRU, `policy.py`).

A hit is a few calls: `match` walks the path comparing each edge inline, `lock`/`touch` mark a
path used in one loop, and the frontier is offered a whole path at once. Keep per-node helper
calls out of these loops; the store runs them on every request.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterator, Sequence
from time import monotonic
from typing import Generic, Protocol

from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.token_ids import TokenIds
from hf_prefix_cache.tree.checks import check_tree
from hf_prefix_cache.tree.compare import common_len, packed_common_len
from hf_prefix_cache.tree.node import Frontier, InsertResult, MatchResult, Node, NodeValue, V
from hf_prefix_cache.tree.policy import ScoreFn, lru_score

# What callers import from here: the tree and the types its answers hold.
__all__ = ["InsertResult", "MatchResult", "Node", "NodeValue", "RadixTree", "lru_score"]


class RadixTree(Generic[V]):
    """A radix tree of symbol sequences with pinned nodes, tiers and eviction order.

    Not thread-safe: the owner serialises calls.

    Args:
        num_tiers: how many tiers nodes can sit on (1: no tiers).
        score: a node's eviction value when used at clock `now` (lower leaves first).

    Example:
        >>> class Blob(bytes):
        ...     nbytes = property(len)
        ...     def split(self, k): return Blob(self[:k]), Blob(self[k:])
        >>> tree = RadixTree()
        >>> _ = tree.insert("ns", [1, 2, 3, 4], lambda a, b: Blob(b"x" * (b - a)))
        >>> tree.match("ns", [1, 2, 9]).matched_len
        2
    """

    def __init__(self, num_tiers: int = 1, score: ScoreFn = lru_score) -> None:
        assert num_tiers >= 1, f"num_tiers={num_tiers}"
        self._roots: dict[Hashable, Node[V]] = {}
        self._clock = itertools.count(1)
        self._score = score
        self._lru = score is lru_score  # then a node's score is its clock, set without a call
        self._frontier: Frontier[Node[V]] = Frontier(num_tiers, self)
        self.tier_nbytes = [0] * num_tiers
        self.num_nodes = 0
        self.num_leaves = 0

    @property
    def num_tiers(self) -> int:
        return len(self.tier_nbytes)

    @property
    def total_nbytes(self) -> int:
        return sum(self.tier_nbytes)

    # ----------------------------------------------------------------- queries
    def match(self, namespace: Hashable, symbols: Sequence[Hashable]) -> MatchResult:
        """Find the longest stored prefix of `symbols` in `namespace`.

        Time is proportional to `len(symbols)`, not to the number of stored entries.
        Does not change the eviction order; call `touch` or `lock` for that.
        """
        root = self._roots.get(namespace)
        if root is None:
            return MatchResult(0, ())
        path: list[Node[V]] = []
        # `seq[pos]` and its length in C: a `TokenIds` is read through its bytes' view (no Python int but the one read).
        seq: Sequence[Hashable] = symbols
        query = None
        if isinstance(symbols, TokenIds):
            seq, query = symbols.view, symbols.packed
        node, pos, n = root, 0, len(seq)
        while pos < n:
            child = node.children.get(seq[pos])
            if child is None:
                break
            size = len(child.key)
            key = child.packed
            if query is not None and key is not None:
                # One memcmp of the whole edge, in place (no copy of the query); only an edge that
                # differs, or that the query ends inside, is searched for where.
                if query.startswith(key, 8 * pos):
                    common = size
                else:
                    common = packed_common_len(key, query, pos, min(size, n - pos))
            else:
                common = common_len(child.key, symbols, pos)
            path.append(child)
            pos += common
            if common < size:
                break
            node = child
        return MatchResult(pos, tuple(path))

    def next_symbols(self, namespace: Hashable, symbols: Sequence[Hashable]) -> list[Hashable]:
        """The symbols stored right after the whole of `symbols` in `namespace` (none where it is not all stored).

        One per stored continuation; like `match`, does not change the eviction order.
        """
        found = self.match(namespace, symbols)
        if found.matched_len < len(symbols):
            return []
        node = found.path[-1] if found.path else self._roots.get(namespace)
        if node is None:
            return []
        if node.end > found.matched_len:  # the match ends inside the node's key
            return [node.key[found.matched_len - node.start]]
        return list(node.children)

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

    def symbols_of(self, node: Node[V]) -> tuple[Hashable, ...]:
        """The whole sequence from the root to the end of `node`."""
        keys: list[tuple[Hashable, ...]] = []
        walk: Node[V] | None = node
        while walk is not None and not walk.is_root:
            keys.append(walk.key)
            walk = walk.parent
        return tuple(s for key in reversed(keys) for s in key)

    # ---------------------------------------------------------------- mutation
    def insert(
        self,
        namespace: Hashable,
        symbols: Sequence[Hashable],
        make_value: _ValueFactory[V],
        tier: int = 0,
    ) -> InsertResult:
        """Store `symbols`, sharing the longest existing prefix.

        `make_value(start, end)` builds the value of the new leaf covering `[start, end)`; it is
        called at most once, and not at all when `symbols` is already stored. An edge that the
        new sequence leaves in its middle is split, with its value split alongside. The new
        leaf sits on `tier`. The whole path is then marked used, as `touch` does.
        """
        seq = symbols.view if isinstance(symbols, TokenIds) else symbols  # length and slices in C
        n = len(seq)
        if not n:
            return InsertResult(0, (), None)
        matched_len, found = self.match(namespace, symbols)
        path = list(found)
        last = path[-1] if path else None
        if last is not None and last.start + len(last.key) > matched_len:  # the query leaves this edge in its middle
            last = path[-1] = self._split(last, matched_len - last.start)
        new_node: Node[V] | None = None
        if matched_len < n:
            parent = last if last is not None else self._roots.get(namespace)
            if parent is None:
                parent = self._roots[namespace] = Node(namespace, None, (), 0)
            # The new ids only (few on a hit; the stored prefix stays bytes), with their bytes where the query has them.
            key = tuple(seq[matched_len:])
            new_node = Node(namespace, parent, key, matched_len)
            if isinstance(symbols, TokenIds):
                new_node.packed = symbols.packed[8 * matched_len :]
            value = make_value(matched_len, n)
            new_node.value = value
            new_node.nbytes = value.nbytes
            new_node.tier = tier
            if parent.children or parent.parent is None:
                self.num_leaves += 1
            parent.children[key[0]] = new_node
            self.tier_nbytes[tier] += new_node.nbytes
            self.num_nodes += 1
            path.append(new_node)
        self.touch(path)
        return InsertResult(matched_len, tuple(path), new_node)

    def set_value(self, node: Node[V], value: V) -> None:
        """Replace `node`'s value, keeping the byte totals exact."""
        self.tier_nbytes[node.tier] += value.nbytes - node.nbytes
        node.value = value
        node.nbytes = value.nbytes
        node.used_at = monotonic()
        node.score = float(node.last_access) if self._lru else self._score(node, node.last_access)  # bytes count
        self._frontier.offer_all((node,))

    def refresh_nbytes(self, node: Node[V]) -> None:
        """Re-read `node.value.nbytes` after the owner changed the value in place."""
        assert node.value is not None, f"{node} has no value"
        self.set_value(node, node.value)

    def set_tier(self, node: Node[V], tier: int) -> None:
        """Record that `node`'s value now lives on `tier`; moves its bytes between the totals."""
        assert 0 <= tier < self.num_tiers and node.parent is not None, f"{node} to tier {tier}"
        self.tier_nbytes[node.tier] -= node.nbytes
        self.tier_nbytes[tier] += node.nbytes
        node.tier = tier
        self._frontier.offer_all((node, node.parent))

    def touch(self, path: Sequence[Node[V]]) -> None:
        """Mark `path` as used now (eviction order)."""
        now, used_at, lru, score = next(self._clock), monotonic(), self._lru, self._score
        for node in path:
            node.last_access = now
            node.used_at = used_at
            node.score = float(now) if lru else score(node, now)
        self._frontier.offer_all(path)

    def lock(self, node: Node[V]) -> None:
        """Pin `node` and its ancestors: pinned nodes are never evicted nor moved. Pair with `unlock(node)`.

        Walking up from the deepest node keeps the count right even if an edge above it is
        split meanwhile (the new head inherits the count).
        """
        now, used_at, lru, score = next(self._clock), monotonic(), self._lru, self._score
        walk: Node[V] | None = node
        while walk is not None and walk.parent is not None:
            walk.lock_ref += 1
            walk.last_access = now  # marked used as `touch` does; a locked node is no candidate
            walk.used_at = used_at
            walk.score = float(now) if lru else score(walk, now)
            walk = walk.parent

    def unlock(self, node: Node[V]) -> None:
        """Let go of one `lock(node)`: nodes no longer pinned become eviction candidates again."""
        freed: list[Node[V]] = []
        walk: Node[V] | None = node
        while walk is not None and walk.parent is not None:
            assert walk.lock_ref > 0, f"unlock of an unlocked node {walk}"
            walk.lock_ref -= 1
            if walk.lock_ref == 0:
                freed.append(walk)
            walk = walk.parent
        if freed:
            self._frontier.offer_all(freed)

    def pop_victim(self, tier: int, leaves_only: bool = False) -> Node[V] | None:
        """The least valuable frontier node of `tier` (see the module docstring), or None.

        The node stays in the tree; the owner moves it to a slower tier or, for a leaf,
        removes it with `remove_leaf`. A node not taken must be handed back with `offer`.
        With `leaves_only`, frontier nodes that still have children are skipped (and kept).
        """
        return self._frontier.pop(tier, leaves_only)

    def offer(self, node: Node[V]) -> None:
        """Make `node` an eviction candidate again if it is one (after `pop_victim` did not take it)."""
        self._frontier.offer_all((node,))

    def evict(self, nbytes_to_free: int) -> list[Node[V]]:
        """Remove the least valuable unlocked leaves, slowest tier first, until `nbytes_to_free` bytes are gone.

        Returns the removed nodes (values still attached) so the owner can release them.
        Frees less when everything left is locked. Evicting 0 bytes is always safe.
        """
        evicted: list[Node[V]] = []
        freed = 0
        tier = self.num_tiers - 1
        while freed < nbytes_to_free and tier >= 0:
            node = self.pop_victim(tier, leaves_only=True)
            if node is None:
                tier -= 1
                continue
            freed += node.nbytes
            self.remove_leaf(node)
            evicted.append(node)
        return evicted

    def remove_leaf(self, node: Node[V]) -> None:
        """Remove the leaf `node` (its value stays attached for the owner to release)."""
        assert node.lock_ref == 0, f"removing a locked leaf {node}"
        parent = self._remove_leaf(node)
        if parent is not None:
            self._frontier.offer_all((parent,))

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
            self._frontier.offer_all((parent,))
        return removed

    def clear(self) -> list[Node[V]]:
        """Remove everything; returns the removed nodes."""
        removed = list(self.iter_nodes())
        for node in removed:
            node.parent = None
        self._roots.clear()
        self._frontier.clear()
        self.tier_nbytes = [0] * self.num_tiers
        self.num_nodes = 0
        self.num_leaves = 0
        return removed

    def check_integrity(self) -> None:
        """Raise `RuntimeError` naming the totals that disagree (see `checks.check_tree`)."""
        check_tree(self, self._frontier.offered())

    # ----------------------------------------------------------------- helpers
    def _remove_leaf(self, node: Node[V]) -> Node[V] | None:
        parent = node.parent
        assert parent is not None and not node.children, f"{node} is not a leaf"
        del parent.children[node.key[0]]
        node.parent = None
        self.tier_nbytes[node.tier] -= node.nbytes
        self.num_nodes -= 1
        if parent.children or parent.is_root:
            self.num_leaves -= 1
        if parent.is_root and not parent.children:
            self._roots.pop(parent.namespace, None)
        return parent

    def _split(self, node: Node[V], offset: int) -> Node[V]:
        """Cut `node` after `offset` symbols; returns the new head, which keeps `node`'s place."""
        if not 0 < offset < len(node.key):
            raise InconsistentStateError(f"split at {offset} of an edge of {len(node.key)}")
        assert node.value is not None and node.parent is not None
        old_nbytes = node.nbytes
        head_value, tail_value = node.value.split(offset)
        head: Node[V] = Node(node.namespace, node.parent, node.key[:offset], node.start)
        if node.packed is not None:
            head.packed, node.packed = node.packed[: 8 * offset], node.packed[8 * offset :]
        head.value = head_value  # type: ignore[assignment]
        head.nbytes = head_value.nbytes
        head.lock_ref = node.lock_ref
        head.last_access = node.last_access
        head.tier = node.tier
        node.parent.children[head.key[0]] = head
        node.parent = head
        node.key = node.key[offset:]
        node.start += offset
        node.value = tail_value  # type: ignore[assignment]
        node.nbytes = tail_value.nbytes
        head.children[node.key[0]] = node
        self.num_nodes += 1
        # A split moves bytes between two nodes; the total changes only if a value's split is lossy.
        self.tier_nbytes[node.tier] += head.nbytes + node.nbytes - old_nbytes
        if self._lru:
            head.score = node.score = float(node.last_access)
        else:  # a cost-aware score depends on the bytes, which the split divided
            head.score = self._score(head, head.last_access)
            node.score = self._score(node, node.last_access)
        self._frontier.offer_all((node,))
        return head


class _ValueFactory(Protocol[V]):  # type: ignore[misc]
    def __call__(self, start: int, end: int) -> V: ...
