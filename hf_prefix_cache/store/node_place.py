"""NodePlace: where a tree node sits, as the `Place` a tier asks about (`storage/tier.py`), answered from the tree.

A tier writing a file needs the node's namespace and whole symbol sequence; the remote tier needs
the segments along it too, read in memory. The tiers never see the tree: they ask this.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from hf_prefix_cache.storage.segments import Segment
from hf_prefix_cache.storage.tier import Tier
from hf_prefix_cache.tree.radix import Node, RadixTree


class NodePlace:
    """The place of `node` in `tree`, whose nodes sit on `tiers`."""

    __slots__ = ("_node", "_tiers", "_tree")

    def __init__(self, tree: RadixTree[Segment], tiers: Sequence[Tier], node: Node[Segment]) -> None:
        assert not node.is_root, "the root holds no segment"
        self._tree = tree
        self._tiers = tiers
        self._node = node

    @property
    def namespace(self) -> str:
        return str(self._node.namespace)

    def symbols(self) -> tuple[Hashable, ...]:
        return self._tree.symbols_of(self._node)

    def segments(self) -> list[Segment]:
        return [_value(node) for node in self._path()]

    def load(self, seg: Segment) -> Segment:
        node = next(n for n in self._path() if n.value is seg)
        return self._tiers[node.tier].get(seg, NodePlace(self._tree, self._tiers, node))

    def _path(self) -> list[Node[Segment]]:
        """The nodes from the root's child down to this one."""
        path: list[Node[Segment]] = []
        walk: Node[Segment] | None = self._node
        while walk is not None and not walk.is_root:
            path.append(walk)
            walk = walk.parent
        path.reverse()
        return path


def _value(node: Node[Segment]) -> Segment:
    assert node.value is not None, f"{node} holds no segment"
    return node.value
