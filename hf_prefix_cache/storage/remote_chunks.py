"""The whole chunks of a stored sequence that the remote server lacks, gathered from the segments along it.

`RemoteTier.put` asks the server which chunks of a place's sequence it lacks (one `EXISTS` round
trip), then has them made here from the place's segments; segments on disk are read (through
`Place.load`) only for missing chunks. Moves nothing and counts nothing.

Knows segments and the chunk format; nothing about the tree.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from hf_prefix_cache.storage.codec import Layout
from hf_prefix_cache.storage.remote_format import ChunkWrite, encode_chunk
from hf_prefix_cache.storage.segments import Segment, join_kv
from hf_prefix_cache.storage.tier import Place


def gather_chunks(
    layout: Layout,
    chunk_len: int,
    place: Place,
    symbols: Sequence[Hashable],
    chain: Sequence[str],
    missing: Sequence[int],
) -> list[ChunkWrite]:
    """The chunks `missing` (indices) of `place`'s sequence `symbols` (keyed by `chain`), encoded for writing.

    Raises:
        CorruptFileError: a file on the sequence could not be read.
    """
    namespace = place.namespace
    path = place.segments()
    loaded: dict[int, Segment] = {}
    return [_chunk(layout, chunk_len, place, namespace, symbols, chain, index, path, loaded) for index in missing]


def _chunk(
    layout: Layout,
    chunk_len: int,
    place: Place,
    namespace: str,
    symbols: Sequence[Hashable],
    chain: Sequence[str],
    index: int,
    path: Sequence[Segment],
    loaded: dict[int, Segment],
) -> ChunkWrite:
    """Chunk `index` of the sequence stored along `path`, gathered from its segments."""
    lo, hi = index * chunk_len, (index + 1) * chunk_len
    pieces = []
    devices: list[torch.device | None] = [None] * layout.num_layers
    snapshot = None
    items = {}
    for i, seg in enumerate(path):
        if seg.end <= lo or seg.start >= hi:
            continue
        if seg.disk is not None:
            if i not in loaded:
                loaded[i] = place.load(seg)
            seg = loaded[i]
        if seg.run is not None:
            pieces.append(seg.run.slice(max(lo, seg.start), min(hi, seg.end)))
            devices = list(seg.run.devices)
        if seg.start < hi <= seg.end:
            snapshot = seg.snapshots.get(hi)
        items.update({n: s for n, s in seg.items.items() if lo < n <= hi})
    if pieces:
        keys, values = join_kv(pieces)
    else:
        keys = values = [None] * layout.num_layers
    return encode_chunk(layout, chunk_len, namespace, symbols, index, chain, keys, values, devices, snapshot, items)
