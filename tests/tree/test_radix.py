"""RadixTree: matching, inserting, splitting, locking and LRU eviction, with plain-Python values (no torch)."""

from __future__ import annotations

import random
from collections.abc import Hashable, Iterator, Sequence
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hf_prefix_cache.testing.reference import longest_prefix
from hf_prefix_cache.tree.radix import Node, RadixTree

BYTES_PER_SYMBOL = 4


class Blob:
    """A fake stored value: the symbols it covers, `BYTES_PER_SYMBOL` bytes each, plus `extra` bytes."""

    def __init__(self, data: Sequence[Hashable], extra: int = 0, header: int = 0) -> None:
        self.data = tuple(data)
        self.extra = extra
        self.header = header

    @property
    def nbytes(self) -> int:
        return self.header + BYTES_PER_SYMBOL * len(self.data) + self.extra

    def split(self, offset: int) -> tuple[Blob, Blob]:
        # `extra` stays with the tail (like a snapshot at the end); a `header` is paid by both halves.
        return Blob(self.data[:offset], 0, self.header), Blob(self.data[offset:], self.extra, self.header)


class Factory:
    """A `make_value` that records its calls and builds the blob of `symbols[start:end]`."""

    def __init__(self, symbols: Sequence[Hashable]) -> None:
        self.symbols = tuple(symbols)
        self.calls: list[tuple[int, int]] = []

    def __call__(self, start: int, end: int) -> Blob:
        self.calls.append((start, end))
        return Blob(self.symbols[start:end])


def put(tree: RadixTree, symbols: Sequence[Hashable], namespace: Hashable = "ns") -> tuple:
    """Insert `symbols`, check the tree, and return the insert result and the factory used."""
    factory = Factory(symbols)
    result = tree.insert(namespace, symbols, factory)
    tree.check_integrity()
    return result, factory


def full_path(node: Node) -> tuple:
    """The symbols from the root down to the end of `node`."""
    keys = []
    walk: Node | None = node
    while walk is not None and not walk.is_root:
        keys.append(walk.key)
        walk = walk.parent
    return tuple(s for key in reversed(keys) for s in key)


def ranges(path: Sequence[Node]) -> list[tuple[int, int]]:
    return [(node.start, node.end) for node in path]


def stored_prefixes(tree: RadixTree) -> dict[Hashable, set[tuple]]:
    """Every non-empty stored prefix, by namespace, read off the tree's nodes."""
    out: dict[Hashable, set[tuple]] = {}
    for node in tree.iter_nodes():
        symbols = full_path(node)
        assert len(symbols) == node.end
        out.setdefault(node.namespace, set()).update(symbols[:k] for k in range(node.start + 1, node.end + 1))
    return out


def longest_stored_prefix(stored: set[tuple], query: Sequence[Hashable]) -> int:
    query = tuple(query)
    k = 0
    while k < len(query) and query[: k + 1] in stored:
        k += 1
    return k


@pytest.fixture
def tree() -> Iterator[RadixTree]:
    t: RadixTree = RadixTree()
    yield t
    t.check_integrity()


# ------------------------------------------------------------------ match


def test_match_on_empty_tree(tree: RadixTree) -> None:
    """A match on an empty tree finds nothing."""
    assert tree.match("ns", [1, 2, 3]) == (0, ())
    assert tree.namespaces() == []


def test_match_in_unknown_namespace(tree: RadixTree) -> None:
    """A match in a namespace that holds nothing finds nothing, even when another namespace holds the query."""
    put(tree, [1, 2, 3], "a")
    assert tree.match("b", [1, 2, 3]) == (0, ())


# Stored: (1, 2, 3, 4, 5, 6) and (1, 2, 3, 7, 8), i.e. [0, 3) -> {[3, 6), [3, 5)}.
@pytest.mark.parametrize(
    ("query", "matched_len", "path_ranges"),
    [
        pytest.param((1, 2, 3, 4, 5, 6), 6, [(0, 3), (3, 6)], id="full"),
        pytest.param((1, 2, 3, 7, 8), 5, [(0, 3), (3, 5)], id="full-other-branch"),
        pytest.param((1, 2, 3, 4, 9, 9), 4, [(0, 3), (3, 6)], id="partial-inside-edge"),
        pytest.param((1, 2, 3, 9), 3, [(0, 3)], id="diverge-at-branch"),
        pytest.param((9, 1, 2, 3), 0, [], id="diverge-at-first-symbol"),
        pytest.param((1, 2), 2, [(0, 3)], id="query-shorter"),
        pytest.param((1, 2, 3, 7, 8, 9, 9, 9), 5, [(0, 3), (3, 5)], id="query-longer"),
        pytest.param((), 0, [], id="empty-query"),
    ],
)
def test_match_longest_prefix(
    tree: RadixTree, query: tuple, matched_len: int, path_ranges: list[tuple[int, int]]
) -> None:
    """A match returns the longest stored prefix and the nodes it runs through, the last one possibly partly."""
    put(tree, (1, 2, 3, 4, 5, 6))
    put(tree, (1, 2, 3, 7, 8))
    result = tree.match("ns", query)
    assert result.matched_len == matched_len
    assert ranges(result.path) == path_ranges
    if result.path:
        last = result.path[-1]
        assert last.start < result.matched_len <= last.end
        assert full_path(last)[: result.matched_len] == tuple(query[: result.matched_len])


def test_match_accepts_lists_and_tuples(tree: RadixTree) -> None:
    """A match treats a list and a tuple of the same symbols alike."""
    put(tree, [1, 2, 3])
    assert tree.match("ns", [1, 2, 3]).matched_len == tree.match("ns", (1, 2, 3)).matched_len == 3


def test_match_does_not_touch(tree: RadixTree) -> None:
    """A match leaves the LRU order alone."""
    result, _ = put(tree, [1, 2, 3])
    before = result.new_node.last_access
    tree.match("ns", [1, 2, 3])
    assert result.new_node.last_access == before


# ----------------------------------------------------------------- insert


def test_insert_into_empty_tree(tree: RadixTree) -> None:
    """A first insert makes one leaf covering the whole sequence, built by one `make_value(0, n)` call."""
    result, factory = put(tree, range(10))
    assert factory.calls == [(0, 10)]
    assert result.matched_len == 0
    assert result.new_node is not None and ranges(result.path) == [(0, 10)]
    assert result.new_node.value.data == tuple(range(10))
    assert tree.num_nodes == 1
    assert tree.total_nbytes == 10 * BYTES_PER_SYMBOL


def test_insert_shares_common_prefix(tree: RadixTree) -> None:
    """Two sequences with a common prefix of 50 store those 50 symbols once."""
    common = list(range(50))
    first, second = common + [100 + i for i in range(30)], common + [200 + i for i in range(20)]
    put(tree, first)
    result, factory = put(tree, second)
    assert factory.calls == [(50, 70)]
    assert result.matched_len == 50
    assert result.new_node is not None and (result.new_node.start, result.new_node.end) == (50, 70)
    assert result.new_node.value.data == tuple(second[50:])
    assert ranges(result.path) == [(0, 50), (50, 70)]
    assert tree.num_nodes == 3  # [0, 50) -> {[50, 80), [50, 70)}
    assert tree.total_nbytes == (50 + 30 + 20) * BYTES_PER_SYMBOL
    assert tree.match("ns", first).matched_len == 80
    assert tree.match("ns", second).matched_len == 70


def test_insert_extends_a_leaf(tree: RadixTree) -> None:
    """Inserting an extension of a stored sequence adds a child for the new tail only."""
    put(tree, [1, 2, 3])
    result, factory = put(tree, [1, 2, 3, 4, 5])
    assert factory.calls == [(3, 5)]
    assert ranges(result.path) == [(0, 3), (3, 5)]
    assert result.new_node.parent is result.path[0]
    assert tree.num_nodes == 2
    assert tree.total_nbytes == 5 * BYTES_PER_SYMBOL


@pytest.mark.parametrize(
    "again",
    [
        pytest.param((1, 2, 3, 4, 5, 6), id="same-sequence"),
        pytest.param((1, 2, 3, 7, 8), id="other-stored-sequence"),
        pytest.param((1, 2, 3), id="prefix-ending-on-an-edge-boundary"),
    ],
)
def test_insert_of_stored_sequence_adds_nothing(tree: RadixTree, again: tuple) -> None:
    """Inserting a stored sequence, or a prefix of one ending on an edge boundary, adds no node and builds no value."""
    put(tree, (1, 2, 3, 4, 5, 6))
    put(tree, (1, 2, 3, 7, 8))
    nodes, nbytes = tree.num_nodes, tree.total_nbytes
    result, factory = put(tree, again)
    assert factory.calls == []
    assert result.new_node is None
    assert result.matched_len == len(again)
    assert result.path[-1].end == len(again)
    assert (tree.num_nodes, tree.total_nbytes) == (nodes, nbytes)


def test_insert_of_prefix_inside_an_edge_splits_but_builds_no_value(tree: RadixTree) -> None:
    """Inserting a prefix that ends inside an edge only splits it, so the returned path ends exactly at the prefix."""
    put(tree, range(10))
    result, factory = put(tree, range(4))
    assert factory.calls == []
    assert result.new_node is None
    assert result.matched_len == 4
    assert ranges(result.path) == [(0, 4)]
    assert tree.num_nodes == 2
    assert tree.total_nbytes == 10 * BYTES_PER_SYMBOL


def test_insert_of_empty_sequence(tree: RadixTree) -> None:
    """Inserting no symbols stores nothing and builds no value."""
    result, factory = put(tree, [])
    assert result == (0, (), None)
    assert factory.calls == []
    assert (tree.num_nodes, tree.total_nbytes) == (0, 0)


def test_insert_of_empty_sequence_adds_no_namespace(tree: RadixTree) -> None:
    """Inserting no symbols leaves `namespaces()` unchanged, as evicting a namespace's last node does."""
    put(tree, [], "a")
    assert tree.namespaces() == []


# ------------------------------------------------------------------ split


def test_split_keeps_parent_link_values_and_bytes(tree: RadixTree) -> None:
    """A split keeps the byte total, gives the head the old parent link and splits the value at the cut."""
    first = tuple(range(10))
    old_leaf = put(tree, first)[0].new_node
    result, factory = put(tree, first[:4] + (99, 98))
    assert factory.calls == [(4, 6)]
    head, new_leaf = result.path
    assert (head.start, head.end) == (0, 4)
    assert head.parent is not None and head.parent.is_root
    assert head.parent.children[0] is head
    assert head.value.data == first[:4]
    # The old node object becomes the tail, under the head.
    assert old_leaf.parent is head
    assert (old_leaf.start, old_leaf.end) == (4, 10)
    assert old_leaf.key == first[4:] and old_leaf.value.data == first[4:]
    assert head.children == {4: old_leaf, 99: new_leaf}
    assert tree.total_nbytes == (10 + 2) * BYTES_PER_SYMBOL
    assert tree.num_nodes == 3


def test_split_of_an_inner_edge(tree: RadixTree) -> None:
    """A split of an edge with children moves them under the tail and keeps every path matchable."""
    put(tree, range(20))
    put(tree, list(range(10)) + [50, 51])  # [0, 10) -> {[10, 20), [10, 12)}
    inner = tree.match("ns", range(10)).path[-1]
    before = tree.total_nbytes
    put(tree, list(range(5)) + [70])  # splits [0, 10) at 5
    head = tree.match("ns", range(5)).path[-1]
    assert (head.start, head.end) == (0, 5)
    assert inner.parent is head and (inner.start, inner.end) == (5, 10)
    assert {(c.start, c.end) for c in inner.children.values()} == {(10, 20), (10, 12)}
    assert all(c.parent is inner for c in inner.children.values())
    assert tree.total_nbytes == before + BYTES_PER_SYMBOL
    assert tree.match("ns", range(20)).matched_len == 20
    assert tree.match("ns", list(range(10)) + [50, 51]).matched_len == 12
    assert tree.match("ns", list(range(5)) + [70]).matched_len == 6


def test_split_of_an_extra_byte_value_keeps_total(tree: RadixTree) -> None:
    """A split of a value whose bytes are not per-symbol keeps the total equal to the nodes' sum."""
    leaf = put(tree, range(10))[0].new_node
    tree.set_value(leaf, Blob(range(10), extra=7))
    put(tree, [0, 1, 2, 99])
    assert leaf.value.extra == 7
    assert tree.total_nbytes == (10 + 1) * BYTES_PER_SYMBOL + 7


def test_lossy_split_is_counted(tree: RadixTree) -> None:
    """A split whose halves each pay a header grows the byte total by that header."""
    leaf = put(tree, range(10))[0].new_node
    tree.set_value(leaf, Blob(range(10), header=16))
    before = tree.total_nbytes
    put(tree, range(4))
    assert tree.total_nbytes == before + 16


# ------------------------------------------------------------- namespaces


def test_namespaces_are_disjoint(tree: RadixTree) -> None:
    """The same symbols under two namespaces never share nodes, and a match in one never sees the other."""
    ra, fa = put(tree, [1, 2, 3], "a")
    rb, fb = put(tree, [1, 2, 3], "b")
    assert fa.calls == fb.calls == [(0, 3)]
    assert ra.new_node is not rb.new_node
    assert (ra.new_node.namespace, rb.new_node.namespace) == ("a", "b")
    assert tree.num_nodes == 2
    assert tree.total_nbytes == 6 * BYTES_PER_SYMBOL
    put(tree, [1, 2, 3, 4, 5], "b")
    assert tree.match("a", [1, 2, 3, 4, 5]).matched_len == 3
    assert tree.match("b", [1, 2, 3, 4, 5]).matched_len == 5
    assert sorted(tree.namespaces()) == ["a", "b"]
    assert {node.namespace for node in tree.match("b", [1, 2, 3, 4, 5]).path} == {"b"}


# ------------------------------------------------------------------- lock


def test_lock_pins_node_and_ancestors(tree: RadixTree) -> None:
    """A lock pins the node and every ancestor, and leaves siblings alone; unlock undoes it."""
    put(tree, range(10))
    put(tree, list(range(5)) + [50])
    put(tree, list(range(10)) + [60])
    deepest = tree.match("ns", list(range(10)) + [60]).path
    sibling = tree.match("ns", list(range(5)) + [50]).path[-1]
    tree.lock(deepest[-1])
    tree.lock(deepest[-1])
    assert [n.lock_ref for n in deepest] == [2, 2, 2]
    assert sibling.lock_ref == 0
    tree.check_integrity()
    tree.unlock(deepest[-1])
    tree.unlock(deepest[-1])
    assert all(n.lock_ref == 0 for n in tree.iter_nodes())


def test_lock_marks_path_used(tree: RadixTree) -> None:
    """A lock refreshes the node and its ancestors in the LRU order."""
    old = put(tree, [1, 2])[0].new_node
    put(tree, [3, 4])
    tree.lock(old)
    tree.unlock(old)
    assert [n.key for n in tree.evict(1)] == [(3, 4)]


def test_locked_path_is_never_evicted(tree: RadixTree) -> None:
    """A locked leaf and its ancestors survive an eviction asking for everything; the rest goes."""
    put(tree, range(10))
    put(tree, list(range(5)) + [50])
    put(tree, [7, 7, 7])
    locked = tree.match("ns", range(10)).path
    tree.lock(locked[-1])
    evicted = tree.evict(10**9)
    tree.check_integrity()
    assert {n.key for n in evicted} == {(50,), (7, 7, 7)}
    assert all(n.parent is not None for n in locked)
    assert tree.total_nbytes == 10 * BYTES_PER_SYMBOL
    assert tree.match("ns", range(10)).matched_len == 10
    tree.unlock(locked[-1])
    assert tree.evict(10**9) and tree.num_nodes == 0 and tree.total_nbytes == 0


def test_unlock_after_split_above_locked_node(tree: RadixTree) -> None:
    """A split of an edge above a locked node hands its count to the new head, so unlock returns every count to 0."""
    first = tuple(range(20))
    put(tree, first)
    put(tree, first[:15] + (99,))  # [0, 15) -> {[15, 20), [15, 16)}
    deepest = tree.match("ns", first).path[-1]
    tree.lock(deepest)
    put(tree, first[:5] + (77,))  # splits [0, 15) at 5, above the locked node
    put(tree, first[:10] + (88,))  # splits [5, 15) at 10
    path = tree.match("ns", first).path
    assert ranges(path) == [(0, 5), (5, 10), (10, 15), (15, 20)]
    assert [n.lock_ref for n in path] == [1, 1, 1, 1]
    # The locked path survives an eviction of everything.
    tree.evict(10**9)
    tree.check_integrity()
    assert tree.match("ns", first).matched_len == 20
    tree.unlock(deepest)
    assert all(n.lock_ref == 0 for n in tree.iter_nodes())
    tree.evict(10**9)
    assert tree.num_nodes == 0


def test_unlock_after_split_of_locked_node(tree: RadixTree) -> None:
    """A split of the locked node itself pins both halves, and unlock releases both."""
    first = tuple(range(10))
    leaf = put(tree, first)[0].new_node
    tree.lock(leaf)
    put(tree, first[:3] + (42,))
    head = leaf.parent
    assert (head.start, head.end, head.lock_ref, leaf.lock_ref) == (0, 3, 1, 1)
    tree.unlock(leaf)
    assert all(n.lock_ref == 0 for n in tree.iter_nodes())


def test_lock_of_partially_matched_node(tree: RadixTree) -> None:
    """Locking the last node of a partial match pins it whole, and its ancestors."""
    put(tree, range(10))
    put(tree, list(range(4)) + [40])
    match = tree.match("ns", list(range(7)) + [0])
    assert match.matched_len == 7
    tree.lock(match.path[-1])
    assert [n.lock_ref for n in match.path] == [1, 1]
    assert [n.key for n in tree.evict(10**9)] == [(40,)]
    tree.unlock(match.path[-1])


def test_unlock_of_unlocked_node_fails(tree: RadixTree) -> None:
    """An unlock without a lock is refused."""
    leaf = put(tree, [1, 2])[0].new_node
    with pytest.raises(AssertionError):
        tree.unlock(leaf)


# ------------------------------------------------------------------ evict


def three_leaves(tree: RadixTree) -> dict[int, Node]:
    """Store (1, 1), (2, 2), (3, 3) in that order; returns their leaves by first symbol."""
    return {s: put(tree, [s, s])[0].new_node for s in (1, 2, 3)}


def test_evict_lru_order(tree: RadixTree) -> None:
    """An eviction takes the least recently used leaf first, and `touch` moves a path to the back."""
    leaves = three_leaves(tree)
    tree.touch(tree.match("ns", [1, 1]).path)
    first = tree.evict(1)
    assert first == [leaves[2]]
    assert first[0].value.data == (2, 2)  # values stay attached for the owner to release
    assert first[0].parent is None
    assert tree.evict(1) == [leaves[3]]
    assert tree.evict(1) == [leaves[1]]
    assert tree.num_nodes == 0 and tree.namespaces() == []


def test_evict_stops_once_enough_is_freed(tree: RadixTree) -> None:
    """An eviction stops as soon as the bytes freed reach the request."""
    leaves = three_leaves(tree)
    leaf_bytes = 2 * BYTES_PER_SYMBOL
    assert tree.evict(leaf_bytes) == [leaves[1]]
    assert tree.evict(leaf_bytes + 1) == [leaves[2], leaves[3]]
    assert tree.total_nbytes == 0


@pytest.mark.parametrize("nbytes", [0, -5])
def test_evict_nothing_is_a_no_op(tree: RadixTree, nbytes: int) -> None:
    """An eviction of zero or fewer bytes removes nothing."""
    three_leaves(tree)
    assert tree.evict(nbytes) == []
    assert tree.num_nodes == 3


def test_evict_empty_tree(tree: RadixTree) -> None:
    """An eviction from an empty tree frees nothing."""
    assert tree.evict(100) == []


def test_evict_takes_only_leaves(tree: RadixTree) -> None:
    """An eviction never takes an inner node, even when it is the least recently used."""
    put(tree, [1, 2, 3, 4])
    put(tree, [1, 2, 3, 5])
    inner = tree.match("ns", [1, 2, 3]).path[-1]
    leaves = list(inner.children.values())
    tree.touch(leaves)  # the inner node is now the oldest
    assert inner.last_access < min(leaf.last_access for leaf in leaves)
    evicted = tree.evict(1)
    assert len(evicted) == 1 and evicted[0] in leaves
    assert inner.parent is not None


def test_evict_parent_after_its_last_child(tree: RadixTree) -> None:
    """An inner node becomes evictable once its last child is gone, in the same eviction."""
    put(tree, [1, 2, 3, 4])
    put(tree, [1, 2, 3, 5])
    put(tree, [9, 9])
    tree.touch(tree.match("ns", [9, 9]).path)
    inner = tree.match("ns", [1, 2, 3]).path[-1]
    evicted = tree.evict(3 * BYTES_PER_SYMBOL)
    assert [n.key for n in evicted[:2]] in ([(4,), (5,)], [(5,), (4,)])
    assert evicted[2] is inner
    assert len(evicted) == 3
    assert tree.match("ns", [1, 2, 3]).matched_len == 0
    assert tree.match("ns", [9, 9]).matched_len == 2


def test_evict_with_everything_locked(tree: RadixTree) -> None:
    """An eviction frees nothing while every leaf is locked."""
    leaves = three_leaves(tree)
    for leaf in leaves.values():
        tree.lock(leaf)
    assert tree.evict(10**9) == []
    assert tree.num_nodes == 3
    for leaf in leaves.values():
        tree.unlock(leaf)


def test_evict_keeps_lru_order_across_namespaces(tree: RadixTree) -> None:
    """An eviction orders the leaves of all namespaces by one clock."""
    a = put(tree, [1], "a")[0].new_node
    b = put(tree, [1], "b")[0].new_node
    a2 = put(tree, [2], "a")[0].new_node
    assert tree.evict(10**9) == [a, b, a2]


# ----------------------------------------------------------- remove, clear


def test_remove_takes_subtree_whatever_the_locks(tree: RadixTree) -> None:
    """A remove takes the node and its whole subtree, locked or not, and keeps the totals exact."""
    put(tree, range(10))
    put(tree, list(range(5)) + [50])
    put(tree, list(range(5)) + [60, 61])
    put(tree, [7, 7])
    mid = tree.match("ns", range(5)).path[-1]
    deepest = tree.match("ns", range(10)).path[-1]
    tree.lock(deepest)
    removed = tree.remove(mid)
    tree.check_integrity()
    assert removed[0] is mid
    assert sorted(n.key for n in removed) == [(0, 1, 2, 3, 4), (5, 6, 7, 8, 9), (50,), (60, 61)]
    assert all(n.parent is None and not n.children for n in removed)
    assert tree.num_nodes == 1
    assert tree.total_nbytes == 2 * BYTES_PER_SYMBOL
    assert tree.match("ns", range(10)).matched_len == 0


def test_remove_of_a_leaf_keeps_its_parent(tree: RadixTree) -> None:
    """A remove of a leaf keeps its parent and siblings."""
    put(tree, [1, 2, 3])
    put(tree, [1, 2, 4])
    leaf = tree.match("ns", [1, 2, 3]).path[-1]
    assert tree.remove(leaf) == [leaf]
    assert tree.match("ns", [1, 2, 4]).matched_len == 3
    assert tree.match("ns", [1, 2, 3]).matched_len == 2
    assert tree.num_nodes == 2


def test_remove_of_locked_subtree_releases_ancestors(tree: RadixTree) -> None:
    """A remove of a locked subtree followed by the paired unlock leaves the ancestors unpinned and evictable."""
    put(tree, range(10))
    put(tree, list(range(5)) + [50])  # [0, 5) -> {[5, 10), [5, 6)}
    top = tree.match("ns", range(5)).path[-1]
    deepest = tree.match("ns", range(10)).path[-1]
    tree.lock(deepest)
    tree.remove(deepest)
    tree.unlock(deepest)
    tree.check_integrity()
    assert top.lock_ref == 0
    assert tree.evict(10**9) != [] and tree.num_nodes == 0


def test_clear_empties_everything(tree: RadixTree) -> None:
    """A clear removes every node of every namespace and returns them."""
    put(tree, [1, 2, 3], "a")
    put(tree, [1, 2, 4], "a")
    put(tree, [1, 2, 3], "b")
    nodes = set(map(id, tree.iter_nodes()))
    removed = tree.clear()
    assert set(map(id, removed)) == nodes and len(removed) == 4
    assert (tree.num_nodes, tree.total_nbytes, tree.namespaces(), list(tree.iter_nodes())) == (0, 0, [], [])
    assert tree.match("a", [1, 2, 3]) == (0, ())
    put(tree, [1, 2, 3], "a")
    assert tree.num_nodes == 1


# ----------------------------------------------------------------- values


def test_set_value_keeps_total_exact(tree: RadixTree) -> None:
    """A `set_value` moves the byte total by the difference between the new and the old value."""
    leaf = put(tree, [1, 2, 3])[0].new_node
    put(tree, [5])
    tree.set_value(leaf, Blob([1, 2, 3], extra=100))
    assert leaf.nbytes == 3 * BYTES_PER_SYMBOL + 100
    assert tree.total_nbytes == 4 * BYTES_PER_SYMBOL + 100
    tree.set_value(leaf, Blob([1, 2, 3]))
    assert tree.total_nbytes == 4 * BYTES_PER_SYMBOL
    tree.check_integrity()


def test_refresh_nbytes_after_in_place_change(tree: RadixTree) -> None:
    """A `refresh_nbytes` picks up a value that grew in place; before it, the integrity check catches the drift."""
    leaf = put(tree, [1, 2, 3])[0].new_node
    leaf.value.extra = 32
    with pytest.raises(RuntimeError, match="caches nbytes"):
        tree.check_integrity()
    tree.refresh_nbytes(leaf)
    assert tree.total_nbytes == 3 * BYTES_PER_SYMBOL + 32
    tree.check_integrity()
    assert tree.evict(1) == [leaf] and tree.total_nbytes == 0


def test_iter_nodes_parents_first(tree: RadixTree) -> None:
    """`iter_nodes` yields every node after its parent."""
    rng = random.Random(1)
    for _ in range(50):
        put(tree, [rng.randrange(3) for _ in range(rng.randrange(1, 8))], rng.choice("ab"))
    seen: set[int] = set()
    for node in tree.iter_nodes():
        assert node.parent.is_root or id(node.parent) in seen
        seen.add(id(node))
    assert len(seen) == tree.num_nodes


# ------------------------------------------------------------------ scale


class CountingDict(dict):
    """A children dict that counts lookups."""

    lookups = 0

    def get(self, key, default=None):  # type: ignore[override]
        CountingDict.lookups += 1
        return super().get(key, default)


def test_match_visits_only_the_query_path_in_a_large_tree(tree: RadixTree) -> None:
    """A match in a tree of 10,000 entries is exact and looks up at most one child per node on its path."""
    rng = random.Random(0)
    stored = [tuple(rng.randrange(20) for _ in range(rng.randrange(1, 40))) for _ in range(10_000)]
    long_entry = tuple(rng.randrange(20) for _ in range(2_000))
    stored.append(long_entry)
    for seq in stored:
        tree.insert("ns", seq, Factory(seq))
    tree.check_integrity()
    assert tree.total_nbytes == BYTES_PER_SYMBOL * len(stored_prefixes(tree)["ns"])
    for node in list(tree.iter_nodes()):
        node.children = CountingDict(node.children)
        if node.parent.is_root and not isinstance(node.parent.children, CountingDict):
            node.parent.children = CountingDict(node.parent.children)

    queries = [
        long_entry,
        long_entry[:1_500] + (99,) * 500,
        long_entry[:1_000] + tuple(rng.randrange(20) for _ in range(1_000)),
        tuple(rng.randrange(20) for _ in range(2_000)),
    ]
    for query in queries:
        CountingDict.lookups = 0
        result = tree.match("ns", query)
        assert result.matched_len == longest_prefix(stored, query)
        assert CountingDict.lookups <= len(result.path) + 1
        assert len(result.path) <= result.matched_len
        assert result.path[0].start == 0
        assert all(a.end == b.start for a, b in pairwise(result.path))
        assert full_path(result.path[-1])[: result.matched_len] == query[: result.matched_len]
    assert tree.match("ns", long_entry).matched_len == 2_000


# --------------------------------------------------------------- property

NAMESPACES = ("a", "b")
SYMBOLS = st.lists(st.integers(0, 3), max_size=8)


class RadixMachine(RuleBasedStateMachine):
    """Random insert / match / lock / unlock / touch / evict / remove / clear against a set-of-prefixes model.

    The model keeps, per namespace, every non-empty stored prefix: inserting a sequence adds all of
    its prefixes, and an evicted or removed node covering `[start, end)` of a path takes away the
    prefixes of that path ending in `(start, end]`.
    """

    def __init__(self) -> None:
        super().__init__()
        self.tree: RadixTree = RadixTree()
        self.model: dict[Hashable, set[tuple]] = {ns: set() for ns in NAMESPACES}
        self.held: list[Node] = []

    def expected_len(self, namespace: Hashable, query: Sequence[int]) -> int:
        return longest_stored_prefix(self.model[namespace], query)

    def check_path(self, path: Sequence[Node], query: Sequence[int], matched_len: int) -> None:
        if matched_len == 0:
            assert path == ()
            return
        assert path[0].start == 0 and path[0].parent.is_root
        assert all(a.end == b.start and b.parent is a for a, b in pairwise(path))
        assert path[-1].start < matched_len <= path[-1].end
        assert full_path(path[-1])[:matched_len] == tuple(query[:matched_len])

    @rule(namespace=st.sampled_from(NAMESPACES), symbols=SYMBOLS)
    def insert(self, namespace: str, symbols: list[int]) -> None:
        expected = self.expected_len(namespace, symbols)
        factory = Factory(symbols)
        result = self.tree.insert(namespace, symbols, factory)
        assert result.matched_len == expected
        if expected == len(symbols):
            assert factory.calls == [] and result.new_node is None
        else:
            assert factory.calls == [(expected, len(symbols))]
            assert result.new_node is result.path[-1]
        self.check_path(result.path, symbols, len(symbols))
        if symbols:
            assert result.path[-1].end == len(symbols)
        self.model[namespace].update(tuple(symbols[:k]) for k in range(1, len(symbols) + 1))

    @rule(namespace=st.sampled_from(NAMESPACES), query=SYMBOLS)
    def match(self, namespace: str, query: list[int]) -> None:
        result = self.tree.match(namespace, query)
        assert result.matched_len == self.expected_len(namespace, query)
        self.check_path(result.path, query, result.matched_len)

    @rule(namespace=st.sampled_from(NAMESPACES), query=SYMBOLS)
    def lock(self, namespace: str, query: list[int]) -> None:
        path = self.tree.match(namespace, query).path
        if path:
            self.tree.lock(path[-1])
            self.held.append(path[-1])

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        node = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.tree.unlock(node)

    @rule(namespace=st.sampled_from(NAMESPACES), query=SYMBOLS)
    def touch(self, namespace: str, query: list[int]) -> None:
        self.tree.touch(self.tree.match(namespace, query).path)

    @rule(nbytes=st.integers(-1, 12 * BYTES_PER_SYMBOL))
    def evict(self, nbytes: int) -> None:
        paths = {id(n): full_path(n) for n in self.tree.iter_nodes()}
        locked = {id(n) for n in self.tree.iter_nodes() if n.lock_ref > 0}
        evicted = self.tree.evict(nbytes)
        freed = sum(n.nbytes for n in evicted)
        if nbytes <= 0:
            assert evicted == []
        remaining = list(self.tree.iter_nodes())
        evictable = [n for n in remaining if not n.children and n.lock_ref == 0]
        if freed < nbytes:
            assert evictable == [], "stopped early while unlocked leaves remain"
        elif evicted:
            assert freed - evicted[-1].nbytes < nbytes, "evicted more than needed"
        if evicted and evictable:
            # Every update here refreshes a whole root path, so parents are never older than children.
            assert max(n.last_access for n in evicted) <= min(n.last_access for n in evictable), "not LRU"
        for node in evicted:
            assert id(node) not in locked, f"evicted locked {node}"
            assert node.parent is None and not node.children
            assert node.value.data == node.key
            symbols = paths[id(node)]
            self.model[node.namespace].difference_update(symbols[:k] for k in range(node.start + 1, node.end + 1))
        for held in self.held:
            assert id(held) in {id(n) for n in remaining}, f"held {held} is gone"

    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        candidates = [n for n in self.tree.iter_nodes() if n.lock_ref == 0]
        if not candidates:
            return
        node = data.draw(st.sampled_from(candidates))
        subtree_symbols = full_path(node)[: node.start + 1]
        subtree = {
            id(n)
            for n in self.tree.iter_nodes()
            if n.namespace == node.namespace and full_path(n)[: node.start + 1] == subtree_symbols
        }
        removed = self.tree.remove(node)
        assert {id(n) for n in removed} == subtree
        stored = self.model[node.namespace]
        stored.difference_update({s for s in stored if len(s) > node.start and s[: node.start + 1] == subtree_symbols})

    @precondition(lambda self: not self.held)
    @rule()
    def clear(self) -> None:
        self.tree.clear()
        self.model = {ns: set() for ns in NAMESPACES}

    @invariant()
    def consistent(self) -> None:
        self.tree.check_integrity()
        got = stored_prefixes(self.tree)
        for ns in NAMESPACES:
            assert got.get(ns, set()) == self.model[ns]
        assert self.tree.total_nbytes == BYTES_PER_SYMBOL * sum(len(s) for s in self.model.values())
        assert set(self.tree.namespaces()) >= {ns for ns in NAMESPACES if self.model[ns]}
        for node in self.tree.iter_nodes():
            assert node.value.data == node.key
        # Each node's count is the number of held locks at or below it.
        expected: dict[int, int] = {}
        for held in self.held:
            walk = held
            while not walk.is_root:
                expected[id(walk)] = expected.get(id(walk), 0) + 1
                walk = walk.parent
        for node in self.tree.iter_nodes():
            assert node.lock_ref == expected.get(id(node), 0), f"{node} expected {expected.get(id(node), 0)}"

    def teardown(self) -> None:
        for node in self.held:
            self.tree.unlock(node)
        self.held = []
        assert all(n.lock_ref == 0 for n in self.tree.iter_nodes())
        self.tree.evict(10**9)
        assert (self.tree.num_nodes, self.tree.total_nbytes) == (0, 0)


RadixMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestRadixMachine = RadixMachine.TestCase
