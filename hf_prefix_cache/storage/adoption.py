"""Adopting remote chunks: a prefix loaded from the remote tier joins the local tree on the device.

The store fetches chunks outside its lock (`RemoteTier.fetch`), then, under it, `adopt` adds
the part past the local match as a new leaf on the device; tiers are kept monotone by
`TierMoves.settle` and budgets by `TierMoves.enforce`. Writing to the remote tier is
`TierMoves.write_remote` (`remote_chunks.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence

from hf_prefix_cache.storage.moves import TierMoves
from hf_prefix_cache.storage.segments import Segment
from hf_prefix_cache.storage.tiers import DEVICE, segment_to_device

logger = logging.getLogger("hf_prefix_cache")


def adopt(moves: TierMoves, namespace: str, symbols: Sequence[Hashable], hit: Segment) -> bool:
    """Add chunks loaded from the remote tier (host segment `hit`, positions `[lo, hi)` of `symbols`) to the tree.

    Only the part past the local match is added, as a new leaf on the device. Returns whether
    anything was added: nothing is when the local tree grew past the hit (or lost the prefix
    it continues) meanwhile, or when the part fits no tier's budget.

    Example:
        >>> adopt(placement, "ns", symbols, remote.fetch("ns", symbols, 0, 4, False).segment)  # doctest: +SKIP
        True
    """
    tree = moves.tree
    have = tree.match(namespace, symbols[: hit.end]).matched_len
    if not hit.start <= have < hit.end:
        return False  # the local tree grew past it, or lost the prefix it continues meanwhile
    part = hit
    if have > hit.start:
        if hit.run is not None:
            hit.run.compact(have, hit.end)
        snapshots = {n: s for n, s in hit.snapshots.items() if n > have}
        items = {n: s for n, s in hit.items.items() if n > have}
        part = Segment(hit.run, have, hit.end, hit.nbytes_per_token, snapshots, items=items)
    if part.nbytes > max(moves.budgets):
        logger.info("not adopting %d remote tokens: larger than every tier's budget", part.end - part.start)
        return False
    states = moves.state_devices(part)
    targets = [*(part.run.devices if part.run is not None else []), *states.values()]
    if all(d is None or d.type == "cpu" for d in targets):
        device_seg = part  # a CPU model: the loaded host tensors are already where they are used
    else:
        device_seg = segment_to_device(part, moves.mover, states)
    result = tree.insert(namespace, symbols[: hit.end], lambda a, b: device_seg, tier=DEVICE)
    assert result.new_node is not None and result.matched_len == have, f"adopted at {result.matched_len}, not {have}"
    moves.counters.num_snapshots += len(device_seg.snapshots)
    leaf = result.path[-1]
    tree.lock(leaf)  # the request that asked for it restores it next
    try:
        moves.settle(result.path)
        moves.enforce()
    finally:
        tree.unlock(leaf)
    return True
