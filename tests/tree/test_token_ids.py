"""TokenIds: token ids with their int64 bytes, which the tree compares instead of Python ints.

The fast path must answer exactly what the per-symbol comparison answers, for every mix of
queries and keys with and without bytes, and keep each node's bytes equal to its key through
inserts and splits.
"""

from __future__ import annotations

import copy
import operator
import pickle
import random
from array import array
from collections.abc import Sequence

import pytest

from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.token_ids import TokenIds
from hf_prefix_cache.tree.compare import common_len, node_common_len
from hf_prefix_cache.tree.radix import RadixTree
from tests.tree.test_radix import Blob, ranges


def ids(values: Sequence[int]) -> TokenIds:
    return TokenIds(values, array("q", values).tobytes())


def test_slices_keep_their_bytes_and_everything_else_behaves_as_the_ids() -> None:
    """Slices carry the bytes of exactly their ids; indexing, steps, equality and hashing are those of the ids."""
    row = ids([5, 6, 7, 2**40, -3])
    for a, b in [(0, 5), (1, 3), (2, 2), (4, 99), (-2, None), (None, -1), (3, 1)]:
        part = row[a:b]
        assert isinstance(part, TokenIds) and part.packed == array("q", part).tobytes()
        assert part == [5, 6, 7, 2**40, -3][a:b]
    assert row[0:5] is row  # a whole slice is the row itself: no copy
    assert row[::2] == (5, 7, -3) and not isinstance(row[::2], TokenIds)
    assert row[3] == 2**40 and row[-1] == -3
    plain = [5, 6, 7, 2**40, -3]
    assert row == plain and operator.eq(plain, row) and row == tuple(plain)  # the list on either side
    assert row != [5, 6, 7, 2**40, -4] and not operator.ne(row, plain)
    assert hash(row) == hash((5, 6, 7, 2**40, -3))
    for copied in (copy.deepcopy(row), pickle.loads(pickle.dumps(row))):
        assert isinstance(copied, TokenIds) and copied == row and copied.packed == row.packed
    with pytest.raises(InconsistentStateError, match="bytes for"):
        TokenIds([1, 2], b"\0" * 8)


@pytest.mark.parametrize("seed", range(6))
def test_bytes_and_ints_find_the_same_common_length(seed: int) -> None:
    """`node_common_len` on bytes equals `common_len` on ints, wherever the first difference lies."""
    rng = random.Random(seed)
    tree: RadixTree[Blob] = RadixTree()
    for _ in range(300):
        n = rng.choice([1, 2, 63, 64, 65, 1000, 5000])
        key = [rng.randrange(-(2**62), 2**62) for _ in range(n)]
        query = key[: rng.randrange(n + 1)] + [rng.randrange(3) for _ in range(rng.randrange(3))]
        if query and rng.random() < 0.5:
            i = rng.randrange(len(query))
            query[i] ^= 1 << rng.randrange(63)  # one bit off, anywhere
        tree.insert("ns", ids(key), lambda a, b, key=key: Blob(key[a:b]))
        node = tree.match("ns", key).path[0]
        assert node.packed is not None
        pos = rng.randrange(2)
        padded = [key[0]] * pos + query
        expected = common_len(node.key, padded, pos)
        assert node_common_len(node, ids(padded), pos) == expected
        assert node_common_len(node, padded, pos) == expected  # a query without bytes compares ints
        tree.clear()


def test_a_tree_of_token_ids_matches_as_a_tree_of_tuples() -> None:
    """Inserting and matching the same sequences as TokenIds and as tuples gives the same matches and
    splits, the nodes keep bytes equal to their keys (the integrity check reads them), and mixed
    queries (bytes against nodes without, and the reverse) give the same answers."""
    rng = random.Random(7)
    fast: RadixTree[Blob] = RadixTree()
    plain: RadixTree[Blob] = RadixTree()
    mixed: RadixTree[Blob] = RadixTree()  # every other sequence inserted without bytes
    stem = [rng.randrange(50_000) for _ in range(400)]
    sequences = []
    for k in range(60):
        cut = rng.randrange(len(stem))
        seq = stem[:cut] + [rng.randrange(50_000) for _ in range(rng.randrange(1, 80))]
        sequences.append(seq)
        results = [
            fast.insert("ns", ids(seq), lambda a, b, s=seq: Blob(s[a:b])),
            plain.insert("ns", tuple(seq), lambda a, b, s=seq: Blob(s[a:b])),
            mixed.insert("ns", ids(seq) if k % 2 else list(seq), lambda a, b, s=seq: Blob(s[a:b])),
        ]
        assert len({(r.matched_len, tuple(ranges(r.path))) for r in results}) == 1
        for t in (fast, plain, mixed):
            t.check_integrity()
    assert all(node.packed is not None for node in fast.iter_nodes())
    assert {node.packed is None for node in mixed.iter_nodes()} == {True, False}
    for seq in sequences:
        query = seq[: rng.randrange(1, len(seq) + 1)] + [50_001]
        answers = [
            (m.matched_len, tuple(ranges(m.path)))
            for m in (
                fast.match("ns", ids(query)),
                plain.match("ns", query),
                mixed.match("ns", ids(query)),
                mixed.match("ns", query),
                fast.match("ns", query),
            )
        ]
        assert len(set(answers)) == 1, answers


def test_the_integrity_check_catches_bytes_that_disagree_with_the_key() -> None:
    """A node whose bytes are not its ids would match a wrong prefix: the check names it."""
    tree: RadixTree[Blob] = RadixTree()
    tree.insert("ns", ids([1, 2, 3]), lambda a, b: Blob([1, 2, 3][a:b]))
    tree.insert("ns", ids([1, 2, 4]), lambda a, b: Blob([1, 2, 4][a:b]))  # splits [1, 2) off
    tree.check_integrity()
    node = tree.match("ns", [1, 2]).path[0]
    assert node.packed == array("q", [1, 2]).tobytes()
    node.packed = array("q", [1, 9]).tobytes()
    with pytest.raises(RuntimeError, match="key bytes are not its token ids"):
        tree.check_integrity()


def test_token_id_queries_that_end_inside_an_edge_or_on_its_boundary() -> None:
    """A query that stops inside an edge, exactly at its end, or runs past it: the byte walk answers
    what the tuple walk answers, and an insert of such a prefix splits the edge there."""
    stored = list(range(100, 300))
    for cut in (1, 63, 64, 65, 100, 199, 200):
        fast: RadixTree[Blob] = RadixTree()
        plain: RadixTree[Blob] = RadixTree()
        for t, seq in ((fast, ids(stored)), (plain, tuple(stored))):
            t.insert("ns", seq, lambda a, b: Blob(stored[a:b]))
        for query, expected in ((stored[:cut], cut), (stored[:cut] + [7], cut), (stored + [7], len(stored))):
            got = fast.match("ns", ids(query))
            want = plain.match("ns", tuple(query))
            assert (got.matched_len, ranges(got.path)) == (want.matched_len, ranges(want.path))
            assert got.matched_len == expected
        result = fast.insert("ns", ids(stored[:cut]), lambda a, b: Blob(stored[a:b]))
        assert result.new_node is None and ranges(result.path) == [(0, cut)]
        fast.check_integrity()


def test_a_match_and_an_insert_read_token_ids_through_their_bytes() -> None:
    """A `TokenIds` query is matched and inserted without building its tuple of Python ints: the new node holds
    only the new ids (with their bytes), and a query ending inside an edge splits it on its bytes too."""
    stored = list(range(1000, 3000))
    tree: RadixTree[Blob] = RadixTree()
    first = TokenIds.from_bytes(array("q", stored).tobytes())
    tree.insert("ns", first, lambda a, b: Blob(stored[a:b]))
    longer = TokenIds.from_bytes(array("q", [*stored, 7, 8, 9]).tobytes())
    assert tree.match("ns", longer).matched_len == 2000
    result = tree.insert("ns", longer, lambda a, b: Blob([*stored, 7, 8, 9][a:b]))
    assert result.matched_len == 2000 and result.new_node is not None
    assert result.new_node.key == (7, 8, 9) and result.new_node.packed == array("q", [7, 8, 9]).tobytes()
    shorter = longer[:1500]
    assert isinstance(shorter, TokenIds)
    assert tree.insert("ns", shorter, lambda a, b: Blob(stored[a:b])).path[-1].end == 1500  # a split, no new node
    assert first._ids is None and longer._ids is None and shorter._ids is None
    tree.check_integrity()
    assert shorter == tuple(stored[:1500]) and hash(shorter) == hash(tuple(stored[:1500]))  # ints made when asked
