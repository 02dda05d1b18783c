"""Writing to the remote tier: the whole chunks of a stored sequence that the server lacks, gathered from the tree.

Called by `Placement` when an entry leaves the last local tier (or, with ``remote_write="through"``,
when it is stored). Costs one `EXISTS` round trip; parts of the sequence on disk are read only
for missing chunks. Moves nothing and counts nothing: the writes are queued on the `RemoteTier`.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence

import torch

from hf_prefix_cache.storage.codec import CorruptFileError
from hf_prefix_cache.storage.disk import DiskTier
from hf_prefix_cache.storage.remote import RemoteTier
from hf_prefix_cache.storage.remote_format import ChunkWrite, chunk_keys, encode_chunk
from hf_prefix_cache.storage.segments import Segment, join_kv
from hf_prefix_cache.tree.radix import Node, RadixTree

logger = logging.getLogger("hf_prefix_cache")


def queue_missing_chunks(
    tree: RadixTree[Segment], remote: RemoteTier, disk: DiskTier | None, node: Node[Segment]
) -> None:
    """Queue the whole chunks of `node`'s sequence that the remote tier lacks (sent by `RemoteTier.flush`).

    Costs one `EXISTS` round trip; parts of the sequence on disk are read only for missing chunks.
    """
    if node.is_root:
        return
    symbols = tree.symbols_of(node)
    num_chunks = len(symbols) // remote.chunk_len
    if num_chunks == 0 or any(type(s) is not int for s in symbols):
        return
    namespace = str(node.namespace)
    missing = remote.missing(namespace, symbols, num_chunks)
    if not missing:
        return
    chain = chunk_keys(namespace, symbols, remote.chunk_len, num_chunks)
    path: list[Node[Segment]] = []
    walk: Node[Segment] | None = node
    while walk is not None and not walk.is_root:
        path.append(walk)
        walk = walk.parent
    path.reverse()
    loaded: dict[int, Segment] = {}
    try:
        writes = [_chunk(disk, remote, namespace, symbols, chain, index, path, loaded) for index in missing]
    except CorruptFileError as exc:
        logger.warning("not writing a prefix to the remote tier: %s", exc)
        return
    remote.queue(writes)


def _chunk(
    disk: DiskTier | None,
    remote: RemoteTier,
    namespace: str,
    symbols: Sequence[Hashable],
    chain: Sequence[str],
    index: int,
    path: Sequence[Node[Segment]],
    loaded: dict[int, Segment],
) -> ChunkWrite:
    """Chunk `index` of the sequence stored along `path`, gathered from its nodes' segments."""
    lo, hi = index * remote.chunk_len, (index + 1) * remote.chunk_len
    pieces = []
    devices: list[torch.device | None] = [None] * remote.layout.num_layers
    snapshot = None
    items = {}
    for node in path:
        seg = node.value
        assert seg is not None
        if seg.end <= lo or seg.start >= hi:
            continue
        if seg.disk is not None:
            assert disk is not None, "a disk segment in a store without a disk tier"
            if id(node) not in loaded:
                loaded[id(node)] = disk.load(seg)
            seg = loaded[id(node)]
        if seg.run is not None:
            pieces.append(seg.run.slice(max(lo, seg.start), min(hi, seg.end)))
            devices = list(seg.run.devices)
        if seg.start < hi <= seg.end:
            snapshot = seg.snapshots.get(hi)
        items.update({n: s for n, s in seg.items.items() if lo < n <= hi})
    if pieces:
        keys, values = join_kv(pieces)
    else:
        keys = values = [None] * remote.layout.num_layers
    return encode_chunk(
        remote.layout, remote.chunk_len, namespace, symbols, index, chain, keys, values, devices, snapshot, items
    )
