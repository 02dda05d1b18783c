"""Common prefix: how many leading symbols a stored edge shares with a query.

On int64 bytes when both carry them (`TokenIds`, `Node.packed`): one `memcmp` of the span, then
halving the span that differs. On Python values otherwise, with slice comparisons in C. The
tree's walk (`RadixTree.match`) writes out the whole-edge byte comparison and calls here only
for an edge that differs or a query without bytes. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

from hf_prefix_cache.token_ids import TokenIds

if TYPE_CHECKING:
    from hf_prefix_cache.tree.radix import Node


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
