"""check_integrity: every invariant between the tree, the runs, the files and the counters, checked at once.

Slow (it walks every node); for tests and for `PrefixCache.check_integrity` after faults.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from hf_prefix_cache.storage.segments import Segment, check_runs, in_host_memory
from hf_prefix_cache.storage.tiers import DISK, HOST, TIER_NAMES
from hf_prefix_cache.tree.radix import RadixTree


def check_integrity(
    tree: RadixTree[Segment], counted_snapshots: int, pooled: Callable[[torch.Tensor], bool] | None = None
) -> None:
    """Raise `RuntimeError` when stored bytes, runs, files or snapshots disagree with the tree.

    Checks that each node's segment covers its range, holds snapshots and item states inside
    it and sits on the tier its storage says; that the segments of a run cover it exactly and
    its tensors hold no extra bytes (a buffer of the host tier's pool, where `pooled` says a tensor
    views one, holds its size class: `host_pool.size_class` of its tensors' bytes); that file
    reference counts match; and that the placement's snapshot count (`counted_snapshots`) is what
    the tree holds.
    """
    tree.check_integrity()
    segments: list[Segment] = []
    disk_refs: Counter[int] = Counter()
    refs: dict[int, Any] = {}
    num_snapshots = 0
    for node in tree.iter_nodes():
        seg = node.value
        assert seg is not None
        num_snapshots += len(seg.snapshots)
        if (seg.start, seg.end) != (node.start, node.end):
            raise RuntimeError(f"{node} holds a segment of [{seg.start}, {seg.end})")
        if any(not seg.start < n <= seg.end for n in seg.snapshots):
            raise RuntimeError(f"{node} holds snapshots outside its range: {sorted(seg.snapshots)}")
        if any(not seg.start < n <= seg.end for n in seg.items):
            raise RuntimeError(f"{node} holds item states outside its range: {sorted(seg.items)}")
        on_disk = seg.disk is not None
        if on_disk != (node.tier == DISK):
            raise RuntimeError(f"{node} sits on tier {TIER_NAMES[node.tier]} but disk={on_disk}")
        if seg.disk is not None:
            disk_refs[id(seg.disk)] += 1
            refs[id(seg.disk)] = seg.disk
            if seg.run is not None:
                raise RuntimeError(f"{node} is on disk but holds a run")
        if seg.run is not None:
            segments.append(seg)
            if node.tier == HOST and not in_host_memory(seg):
                raise RuntimeError(f"{node} is on the host tier but holds tensors elsewhere")
    if num_snapshots != counted_snapshots:
        raise RuntimeError(f"counted {counted_snapshots} snapshots, the tree holds {num_snapshots}")
    for key, count in disk_refs.items():
        if refs[key].num_refs != count:
            raise RuntimeError(f"{refs[key].path} counts {refs[key].num_refs} refs, tree has {count}")
    check_runs(segments, pooled)
