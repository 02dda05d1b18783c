"""check_tree: every invariant of a radix tree (links, cached sizes, locks, per-tier totals, frontier), checked at once.

Slow (it walks every node); for tests and after faults (`RadixTree.check_integrity`).
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING, Any, cast

from hf_prefix_cache.tree.node import can_leave

if TYPE_CHECKING:
    from hf_prefix_cache.tree.radix import RadixTree


def check_tree(tree: RadixTree[Any], offered: set[tuple[int, float]]) -> None:
    """Raise `RuntimeError` naming the totals of `tree` that disagree; `offered` holds its frontier's entries.

    >>> from hf_prefix_cache.tree.radix import RadixTree
    >>> check_tree(RadixTree(), set())
    """
    nbytes = [0] * tree.num_tiers
    count = 0
    leaves = 0
    for node in tree.iter_nodes():
        count += 1
        leaves += not node.children
        nbytes[node.tier] += node.nbytes
        assert node.parent is not None
        if node.start != node.parent.end:
            raise RuntimeError(f"{node} starts at {node.start} but its parent ends at {node.parent.end}")
        if not node.key or node.parent.children.get(node.key[0]) is not node:
            raise RuntimeError(f"{node} is not linked under its first symbol")
        if node.packed is not None and node.packed != array("q", cast("tuple[int, ...]", node.key)).tobytes():
            raise RuntimeError(f"{node}'s key bytes are not its token ids")  # a match would read a wrong prefix
        if node.value is None or node.value.nbytes != node.nbytes:
            raise RuntimeError(f"{node} caches nbytes={node.nbytes}, value says otherwise")
        # A node's count includes its children's (locks walk up), so it is at least their sum.
        locked_children = sum(c.lock_ref for c in node.children.values())
        if node.lock_ref < locked_children:
            raise RuntimeError(f"{node} lock_ref={node.lock_ref} below its children's {locked_children}")
        if can_leave(node) and (id(node), node.score) not in offered:
            raise RuntimeError(f"{node} can leave tier {node.tier} but is not a candidate")
    if nbytes != tree.tier_nbytes:
        raise RuntimeError(f"tier_nbytes={tree.tier_nbytes} but nodes hold {nbytes}")
    if count != tree.num_nodes:
        raise RuntimeError(f"num_nodes={tree.num_nodes} but the tree has {count}")
    if leaves != tree.num_leaves:
        raise RuntimeError(f"num_leaves={tree.num_leaves} but the tree has {leaves}")
