"""check_integrity: every invariant between the tree, the runs, the files and the counters, checked at once.

Slow (it walks every node); for tests and for `PrefixCache.check_integrity` after faults.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from hf_prefix_cache.model.runs import Run
from hf_prefix_cache.storage.host_pool import size_class
from hf_prefix_cache.storage.segments import Segment
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
    covered: dict[int, list[tuple[int, int]]] = {}
    runs: dict[int, Run] = {}
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
            runs[id(seg.run)] = seg.run
            covered.setdefault(id(seg.run), []).append((seg.start, seg.end))
            want = "cpu" if node.tier == HOST else None
            for t in seg.run.keys:
                if t is not None and want is not None and t.device.type != want:
                    raise RuntimeError(f"{node} is on the host tier but holds tensors on {t.device}")
    if num_snapshots != counted_snapshots:
        raise RuntimeError(f"counted {counted_snapshots} snapshots, the tree holds {num_snapshots}")
    for key, count in disk_refs.items():
        if refs[key].num_refs != count:
            raise RuntimeError(f"{refs[key].path} counts {refs[key].num_refs} refs, tree has {count}")
    for key, run in runs.items():
        # The storages a run's tensors view (one each, or one batched host copy for all) hold just their bytes.
        tensors = [t for t in run.keys + run.values if t is not None]
        # Keyed by address; meta tensors have none (every one reads 0), so they are keyed by the tensor they view.
        storages: dict[tuple[str, int], list[torch.Tensor]] = {}
        for t in tensors:
            storages.setdefault(_storage_key(t), []).append(t)
        for members in storages.values():
            held, needed = members[0].untyped_storage().nbytes(), sum(t.nbytes for t in members)
            allowed = size_class(needed) if pooled is not None and pooled(members[0]) else needed
            if held != allowed:
                raise RuntimeError(f"run [{run.lo}, {run.hi}) keeps {held} bytes for tensors of {needed}")
        spans = sorted(covered[key])
        if run.num_refs != len(spans):
            raise RuntimeError(f"run [{run.lo}, {run.hi}) counts {run.num_refs} refs, tree has {len(spans)}")
        if (
            spans[0][0] != run.lo
            or spans[-1][1] != run.hi
            or any(spans[i][1] != spans[i + 1][0] for i in range(len(spans) - 1))
        ):
            raise RuntimeError(f"run [{run.lo}, {run.hi}) is covered by {spans}")


def _storage_key(tensor: Any) -> tuple[str, int]:
    ptr = tensor.untyped_storage().data_ptr()
    if ptr:
        return (tensor.device.type, ptr)
    # Meta tensors have no address: views of one tensor (a packed copy's) share its storage, others their own.
    return ("no address", id(tensor._base if tensor._base is not None else tensor))
