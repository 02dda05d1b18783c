"""Adopting remote chunks: a prefix loaded from the remote tier joins the local tree on the device.

The store loads chunks outside its lock (`RemoteTier.get`), then, under it, `adopt` adds
the part past the local match as a new leaf on the device; `Placement.adopt` then keeps tiers
monotone (`settle`) and budgets (`enforce`). Writing to the remote tier is `Placement.write_remote`.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence

from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.storage.memory import DeviceTier
from hf_prefix_cache.storage.segments import Segment, tail_from
from hf_prefix_cache.storage.tier import Standalone
from hf_prefix_cache.storage.tiers import DEVICE
from hf_prefix_cache.tree.radix import InsertResult, RadixTree

logger = logging.getLogger("hf_prefix_cache")


def adopt(
    tree: RadixTree[Segment],
    device: DeviceTier,
    largest_budget: int,
    namespace: str,
    symbols: Sequence[Hashable],
    hit: Segment,
) -> InsertResult | None:
    """Add chunks loaded from the remote tier (host segment `hit`, positions `[lo, hi)` of `symbols`) to `tree`.

    Only the part past the local match is added, as a new leaf on the `device` tier. Returns the
    insert's result, or None when nothing was added: the local tree grew past the hit (or lost the
    prefix it continues) meanwhile, or the part is larger than `largest_budget`.

    Example:
        >>> hit = remote.get(Segment(None, 0, 1024, 0), Standalone("ns", symbols))  # doctest: +SKIP
        >>> adopt(tree, device, 1 << 30, "ns", symbols, hit)  # doctest: +SKIP
        InsertResult(matched_len=0, ...)
    """
    have = tree.match(namespace, symbols[: hit.end]).matched_len
    if not hit.start <= have < hit.end:
        return None  # the local tree grew past it, or lost the prefix it continues meanwhile
    part = tail_from(hit, have) if have > hit.start else hit
    if part.nbytes > largest_budget:
        logger.info("not adopting %d remote tokens: larger than every tier's budget", part.end - part.start)
        return None
    # A CPU model: the loaded host tensors are already where they are used.
    device_seg = (
        part if device.holds_as_is(part) else device.put(part, Standalone(namespace, tuple(symbols[: hit.end])))
    )
    result = tree.insert(namespace, symbols[: hit.end], lambda a, b: device_seg, tier=DEVICE)
    if result.new_node is None or result.matched_len != have:
        raise InconsistentStateError(f"adopted at {result.matched_len}, not {have}")
    return result
