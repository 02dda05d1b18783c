"""The remote tier's chunks: their keys, chained over the symbols, and their values, encoded and checked.

A chunk holds positions `[i * chunk_len, (i + 1) * chunk_len)` of one symbol sequence (token
ids and media symbols): their keys/values, the recurrent snapshot taken exactly at its end (if
any) and the item states of media placeholders ending inside it.

Keys: ``hfpc:<format>:<namespace>:<chain>``, where `chain` is a 128-bit xxh3 chained over the
previous chunk's chain and this chunk's symbols (seeded by the namespace, the format and the
chunk length). No Python `hash()` is involved, so every process and machine computes the same
keys. The namespace (model class, config, weights fingerprint, dtype, adapters, salt) is in the
key and in the value, so tenants with different salts never share a chunk.

Values: one self-describing safetensors blob per chunk (the disk tier's encoding of states),
whose JSON metadata holds the namespace, the previous chain, the range, the chunk's symbols, the
layout and an xxh3-128 checksum of the tensors. A loaded chunk is checked against the query
before use (`decode_chunk`): a hash collision or a foreign writer is a miss, never a wrong hit.
Nothing is unpickled.

Knows segments and the encoding; nothing about the server or the tree.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.model.runs import Run
from hf_prefix_cache.model.states import ItemState, Snapshot
from hf_prefix_cache.storage.codec import CorruptFileError, Layout, decode, encode, stored_devices, verified
from hf_prefix_cache.storage.segments import DiskRef, Segment

logger = logging.getLogger("hf_prefix_cache")

FORMAT = "hf_prefix_cache.chunk/1"
_META_KEY = "hf_prefix_cache"
_KEY_PREFIX = "hfpc:c1:"


class BadChunkError(Exception):
    """A chunk value that cannot be read, is truncated or fails its checksum."""


def chunk_keys(namespace: str, symbols: Sequence[Hashable], chunk_len: int, num_chunks: int) -> list[str]:
    """The keys of the first `num_chunks` chunks of `symbols`, each chained over the previous one.

    >>> a = chunk_keys("ns", list(range(8)), 4, 2)
    >>> b = chunk_keys("ns", [0, 1, 2, 3, 9, 9, 9, 9], 4, 2)
    >>> a[0] == b[0], a[1] == b[1]
    (True, False)
    """
    if num_chunks * chunk_len > len(symbols):
        raise InconsistentStateError(f"{num_chunks} chunks of {chunk_len} over {len(symbols)} symbols")
    chain = _seed(namespace, chunk_len)
    keys = []
    for i in range(num_chunks):
        chain = _next_chain(chain, symbols[i * chunk_len : (i + 1) * chunk_len])
        keys.append(f"{_KEY_PREFIX}{namespace}:{chain}")
    return keys


def _seed(namespace: str, chunk_len: int) -> str:
    return xxhash.xxh3_128_hexdigest(f"{FORMAT}|{namespace}|{chunk_len}".encode())


def _chain_of(key: str) -> str:
    return key.rsplit(":", 1)[1]


def _next_chain(prev: str, symbols: Sequence[Hashable]) -> str:
    # Symbols are ints of any size (media symbols exceed 64 bits): their decimal text is exact.
    return xxhash.xxh3_128_hexdigest(prev.encode() + b"|" + ",".join(str(int(s)) for s in symbols).encode())  # type: ignore[call-overload]


@dataclass(slots=True)
class ChunkWrite:
    """One chunk waiting to be sent: its key and safetensors contents (CPU tensors and metadata)."""

    key: str
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def blob(self) -> bytes:
        """The value stored on the server: the tensors as safetensors, the metadata as JSON in its header."""
        return save_tensors(self.tensors, metadata={_META_KEY: json.dumps(self.meta)})


def encode_chunk(
    layout: Layout,
    chunk_len: int,
    namespace: str,
    symbols: Sequence[Hashable],
    index: int,
    chain: Sequence[str],
    keys: list[torch.Tensor | None],
    values: list[torch.Tensor | None],
    devices: list[torch.device | None],
    snapshot: Snapshot | None,
    items: dict[int, ItemState],
) -> ChunkWrite:
    """Chunk `index` of `symbols`: keys/values `[B, H, chunk_len, D]` per layer, its end snapshot, item states.

    `chain` holds the chunk keys of `symbols` (`chunk_keys`) up to at least this one. Tensors
    are copied to the CPU here (under the store's lock); `RemoteTier.flush` serialises and sends them.
    """
    lo, hi = index * chunk_len, (index + 1) * chunk_len
    prev = _chain_of(chain[index - 1]) if index else _seed(namespace, chunk_len)
    meta: dict[str, Any] = {
        "format": FORMAT,
        "namespace": namespace,
        "prev": prev,
        "lo": lo,
        "hi": hi,
        "symbols": [int(s) for s in symbols[lo:hi]],  # type: ignore[call-overload]
        "layout": _layout_json(layout),
        "devices": [str(d) if d is not None else None for d in devices],
    }
    tensors = encode(keys, values, {hi: snapshot} if snapshot is not None else {}, items, meta)
    return ChunkWrite(chain[index], tensors, meta)


def decode_chunk(
    layout: Layout,
    chunk_len: int,
    blob: bytes,
    namespace: str,
    symbols: Sequence[Hashable],
    index: int,
    chain: Sequence[str],
) -> Segment | None:
    """Chunk `index` from `blob` as a host segment, or None when it belongs to another sequence (logged).

    Raises:
        BadChunkError: the value is not a whole chunk of this format, or fails its checksum.
    """
    lo, hi = index * chunk_len, (index + 1) * chunk_len
    key = chain[index]
    try:
        meta = _read_meta(blob)
        tensors = load_tensors(blob)
    except Exception as exc:
        raise BadChunkError(f"unreadable value ({type(exc).__name__}: {exc})") from exc
    if meta.get("format") != FORMAT:
        raise BadChunkError(f"unknown format {meta.get('format')!r}")
    if not verified(tensors, meta):
        raise BadChunkError("fails its checksum")
    expected_prev = _chain_of(chain[index - 1]) if index else _seed(namespace, chunk_len)
    same = (
        meta.get("namespace") == namespace
        and (meta.get("lo"), meta.get("hi")) == (lo, hi)
        and meta.get("prev") == expected_prev
        and meta.get("symbols") == [int(s) for s in symbols[lo:hi]]  # type: ignore[call-overload]
    )
    if not same:
        logger.warning("remote chunk %s holds another sequence (a hash collision or a foreign writer); ignored", key)
        return None
    if meta.get("layout") != _layout_json(layout):
        raise BadChunkError(f"layout {meta.get('layout')} does not fit the model's {_layout_json(layout)}")
    devices = [torch.device(d) if d is not None else None for d in stored_devices(meta, layout.num_layers)]
    stub = Segment(None, lo, hi, 0, disk=DiskRef(Path(key), lo, hi, devices))
    try:
        keys, values, snapshots, items = decode(tensors, meta, layout, stub)
    except (CorruptFileError, KeyError, ValueError, TypeError) as exc:
        raise BadChunkError(f"bad keys or states: {exc}") from exc
    for k, v in zip(keys, values, strict=True):
        if (k is None) != (v is None) or (k is not None and v is not None and k.shape[-2] != hi - lo):
            raise BadChunkError(f"keys/values do not cover {hi - lo} positions")
    run = None
    if layout.kv_layers:
        run = Run(keys, values, lo, hi, devices=devices)
        run.take()
    if any(n != hi for n in snapshots):
        raise BadChunkError(f"snapshots at {sorted(snapshots)}, a chunk carries only the one at {hi}")
    nbytes_per_token = run.nbytes_per_token if run is not None else 0
    return Segment(run, lo, hi, nbytes_per_token, snapshots, items=items)


def join_chunks(chunks: list[Segment]) -> Segment:
    """Consecutive host chunks as one segment on one run."""
    if len(chunks) == 1:
        return chunks[0]
    first, last = chunks[0], chunks[-1]
    snapshots = {n: s for c in chunks for n, s in c.snapshots.items()}
    items = {n: s for c in chunks for n, s in c.items.items()}
    run = None
    if first.run is not None:
        keys: list[torch.Tensor | None] = []
        values: list[torch.Tensor | None] = []
        for i in range(len(first.run.keys)):
            ks = [c.run.keys[i] for c in chunks if c.run is not None]
            vs = [c.run.values[i] for c in chunks if c.run is not None]
            keys.append(torch.cat(ks, dim=-2) if ks[0] is not None else None)  # type: ignore[arg-type]
            values.append(torch.cat(vs, dim=-2) if vs[0] is not None else None)  # type: ignore[arg-type]
        run = Run(keys, values, first.start, last.end, devices=list(first.run.devices))
        run.take()
    return Segment(run, first.start, last.end, first.nbytes_per_token, snapshots, items=items)


def _read_meta(blob: bytes) -> dict[str, Any]:
    """The JSON metadata of a safetensors blob, after checking the blob holds every byte its header names."""
    if len(blob) < 8:
        raise ValueError(f"{len(blob)} bytes")
    header_len = int.from_bytes(blob[:8], "little")
    if header_len > len(blob) - 8:
        raise ValueError(f"truncated header: {len(blob)} bytes, header needs {8 + header_len}")
    header = json.loads(blob[8 : 8 + header_len])
    ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    if len(blob) != 8 + header_len + max(ends, default=0):
        raise ValueError(f"truncated: {len(blob)} bytes, header needs {8 + header_len + max(ends, default=0)}")
    meta = json.loads(header["__metadata__"][_META_KEY])
    if not isinstance(meta, dict):
        raise ValueError("metadata is not an object")
    return meta


def _layout_json(layout: Layout) -> dict[str, Any]:
    return {
        "num_layers": layout.num_layers,
        "kv_layers": list(layout.kv_layers),
        "state_layers": list(layout.state_layers),
        "item_layers": list(layout.item_layers),
    }
