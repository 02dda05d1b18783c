"""The remote tier: fixed-length chunks of stored prefixes in Redis (or Valkey), shared by processes and machines.

Below the last local tier. A chunk holds positions `[i * chunk_len, (i + 1) * chunk_len)` of one
symbol sequence (token ids and media symbols): their keys/values, the recurrent snapshot taken
exactly at its end (if any) and the item states of media placeholders ending inside it. Only
whole chunks are stored; a sequence's last partial chunk stays local.

Keys: ``hfpc:<format>:<namespace>:<chain>``, where `chain` is a 128-bit xxh3 chained over the
previous chunk's chain and this chunk's symbols (seeded by the namespace, the format and the
chunk length). No Python `hash()` is involved, so every process and machine computes the same
keys. The namespace (model class, config, weights fingerprint, dtype, adapters, salt) is in the
key and in the value, so tenants with different salts never share a chunk.

Values: one self-describing safetensors blob per chunk (the disk tier's encoding of states),
whose JSON metadata holds the namespace, the previous chain, the range, the chunk's symbols, the
layout and an xxh3-128 checksum of the tensors. A loaded chunk is checked against the query
before use: a hash collision or a foreign writer is a miss, never a wrong hit. Nothing is
unpickled.

The server evicts (`maxmemory` with `allkeys-lru`); a chunk that vanished between lookup and
load makes the hit shorter. A server that is down, slow or full never fails a request: calls are
bounded by `timeout`, after a connection error the tier is skipped for a growing back-off (1 s
up to 30 s) and the client reconnects by itself; the caller counts the reason.

The interface the store uses (kept small so it can move under a `storage/` package):

- `RemoteTier.chunk_len`, `RemoteTier.missing(namespace, symbols, num_chunks)` (one pipelined
  `EXISTS` round trip), `RemoteTier.queue(write)` and `RemoteTier.flush()` (one pipelined `SET`
  round trip, called outside the store's lock);
- `RemoteTier.fetch(namespace, symbols, first, last, need_snapshot)` -> `RemoteHit` (one
  pipelined `EXISTS`, then one `MGET`).

Knows segments, chunk encoding and the server; nothing about the tree.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

import torch
import xxhash
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from hf_prefix_cache import reasons
from hf_prefix_cache.model.states import ItemState, Run, Snapshot
from hf_prefix_cache.storage.codec import (
    CorruptFileError,
    Layout,
    checksum,
    states_from_file,
    states_to_file,
    stored_devices,
)
from hf_prefix_cache.storage.segments import DiskRef, Segment

if TYPE_CHECKING:
    from collections.abc import Hashable, Sequence

logger = logging.getLogger("hf_prefix_cache")

FORMAT = "hf_prefix_cache.chunk/1"
_META_KEY = "hf_prefix_cache"
_KEY_PREFIX = "hfpc:c1:"
_SCHEMES = ("redis", "rediss", "unix")
_MAX_BACKOFF = 30.0


class BadChunkError(Exception):
    """A chunk value that cannot be read, is truncated or fails its checksum."""


def redact(url: str) -> str:
    """`url` with any password replaced by ``***`` (for logs and messages).

    >>> redact("redis://user:secret@host:6379/0")
    'redis://user:***@host:6379/0'
    """
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port is not None else ""
    return urlunsplit((parts.scheme, f"{user}:***@{host}{port}", parts.path, parts.query, parts.fragment))


def chunk_keys(namespace: str, symbols: Sequence[Hashable], chunk_len: int, num_chunks: int) -> list[str]:
    """The keys of the first `num_chunks` chunks of `symbols`, each chained over the previous one.

    >>> a = chunk_keys("ns", list(range(8)), 4, 2)
    >>> b = chunk_keys("ns", [0, 1, 2, 3, 9, 9, 9, 9], 4, 2)
    >>> a[0] == b[0], a[1] == b[1]
    (True, False)
    """
    assert num_chunks * chunk_len <= len(symbols), f"{num_chunks} chunks of {chunk_len} over {len(symbols)} symbols"
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


@dataclass(slots=True)
class RemoteHit:
    """Chunks loaded for positions `[lo, hi)`, joined into one host segment of that range (None: nothing loaded).

    `error` names why the server could not be asked (``"remote_unavailable"``), else None.
    """

    segment: Segment | None = None
    error: str | None = None


@dataclass(slots=True)
class RemoteCounters:
    hits: int = 0
    hit_tokens: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    errors: int = 0
    skipped_writes: int = 0


class RemoteTier:
    """Chunks of stored prefixes in a Redis or Valkey server.

    Args:
        url: ``redis://[user:password@]host:port/db``, ``rediss://...`` (TLS) or ``unix://path``.
        layout: what a chunk must hold to fit the model (layers with keys, states, item states).
        chunk_len: symbols per chunk.
        ttl: seconds a written chunk lives on the server (None: until the server evicts it).
        timeout: seconds any one call may wait for the server (connect, read, write).
        max_write_bytes: the most bytes one entry may write (None: no limit).

    Raises:
        ValueError: for a URL of another scheme.
        ImportError: when the `redis` package is missing (``pip install 'hf-prefix-cache[remote]'``).

    Example:
        >>> tier = RemoteTier("redis://localhost:6379/0", layout)  # doctest: +SKIP
        >>> tier.fetch(namespace, symbols, 0, 4, need_snapshot=False).hi  # doctest: +SKIP
        1024
    """

    def __init__(
        self,
        url: str,
        layout: Layout,
        *,
        chunk_len: int = 256,
        ttl: float | None = None,
        timeout: float = 2.0,
        max_write_bytes: int | None = None,
    ) -> None:
        if urlsplit(url).scheme not in _SCHEMES:
            raise ValueError(
                f"remote must be a redis://, rediss:// or unix:// URL, got {redact(url)!r} "
                "(e.g. remote='redis://localhost:6379/0')"
            )
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("the remote tier needs the redis client: pip install 'hf-prefix-cache[remote]'") from exc
        self.url = redact(url)
        self.layout = layout
        self.chunk_len = chunk_len
        self.ttl = ttl
        self.max_write_bytes = max_write_bytes
        # One retry on a connection error: a pooled connection left over from before a server
        # restart fails once, then reconnects. A timeout is not retried: one timeout per call.
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
            health_check_interval=30,
            socket_read_size=1 << 20,  # chunk values are megabytes: 32 KiB reads cost a Python call each
        )
        # Any server-side or transport error (down, timeout, AUTH refused, a command refused) disables
        # the tier for a back-off; none reaches the request.
        self._errors = (redis.exceptions.RedisError, OSError)
        self._redis_error = redis.exceptions.RedisError
        self.counters = RemoteCounters()
        self._lock = threading.Lock()  # counters, back-off and the write queue; never held over I/O
        self._pending: list[ChunkWrite] = []
        self._down_until = 0.0
        self._backoff = 1.0
        self._down = False
        self._warned = False

    # ------------------------------------------------------------ health
    def reset_counters(self) -> None:
        """Zero every counter."""
        with self._lock:
            self.counters = RemoteCounters()

    @property
    def available(self) -> bool:
        """False while backing off after a connection error."""
        return time.monotonic() >= self._down_until

    def _failed(self, exc: BaseException) -> None:
        with self._lock:
            self.counters.errors += 1
            self._down_until = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, _MAX_BACKOFF)
            first, self._warned = not self._warned, True
            self._down = True
            wait = self._down_until - time.monotonic()
        (logger.warning if first else logger.info)(
            "remote prefix cache %s unreachable (%s: %s); serving from local tiers, asking again in %.0f s",
            self.url,
            type(exc).__name__,
            exc,
            wait,
        )

    def _succeeded(self) -> None:
        if self._down:
            with self._lock:
                self._down, self._backoff = False, 1.0
            logger.info("remote prefix cache %s reachable again", self.url)

    # ------------------------------------------------------------ writing
    def missing(self, namespace: str, symbols: Sequence[Hashable], num_chunks: int) -> list[int]:
        """Indices of the first `num_chunks` chunks of `symbols` the server lacks (none while it is down)."""
        if num_chunks <= 0 or not self.available:
            return []
        keys = chunk_keys(namespace, symbols, self.chunk_len, num_chunks)
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            found = pipe.execute()
        except self._errors as exc:
            self._failed(exc)
            return []
        self._succeeded()
        return [i for i, n in enumerate(found) if not n]

    def encode(
        self,
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
        are copied to the CPU here (under the store's lock); `flush` serialises and sends them.
        """
        lo, hi = index * self.chunk_len, (index + 1) * self.chunk_len
        prev = _chain_of(chain[index - 1]) if index else _seed(namespace, self.chunk_len)
        tensors: dict[str, torch.Tensor] = {}
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            if k is not None and v is not None:
                tensors[f"k.{i}"] = k.detach().to("cpu").contiguous()
                tensors[f"v.{i}"] = v.detach().to("cpu").contiguous()
        snapshots = states_to_file("s", {hi: snapshot} if snapshot is not None else {}, tensors)
        item_meta = states_to_file("i", items, tensors)
        meta = {
            "format": FORMAT,
            "namespace": namespace,
            "prev": prev,
            "lo": lo,
            "hi": hi,
            "symbols": [int(s) for s in symbols[lo:hi]],  # type: ignore[call-overload]
            "layout": _layout_json(self.layout),
            "devices": [str(d) if d is not None else None for d in devices],
            "snapshots": snapshots,
            "items": item_meta,
        }
        meta["checksum"] = checksum(tensors, meta)  # covers the metadata too, as on disk
        return ChunkWrite(chain[index], tensors, meta)

    def queue(self, writes: Sequence[ChunkWrite]) -> None:
        """Hold `writes` for the next `flush`, unless together they exceed `max_write_bytes` (then counted, skipped)."""
        total = sum(w.nbytes for w in writes)
        with self._lock:
            if self.max_write_bytes is not None and total > self.max_write_bytes:
                self.counters.skipped_writes += len(writes)
                logger.info("not writing %d bytes to the remote tier: over max_remote_bytes", total)
                return
            self._pending.extend(writes)

    def flush(self) -> None:
        """Send the queued chunks in one pipelined round trip; a full server skips (and counts) them."""
        with self._lock:
            writes, self._pending = self._pending, []
        if not writes:
            return
        if not self.available:
            with self._lock:
                self.counters.skipped_writes += len(writes)
            return
        blobs = [save_tensors(w.tensors, metadata={_META_KEY: json.dumps(w.meta)}) for w in writes]
        ttl = int(self.ttl * 1000) if self.ttl is not None else None
        try:
            pipe = self._client.pipeline(transaction=False)
            for w, blob in zip(writes, blobs, strict=True):
                pipe.set(w.key, blob, px=ttl)
            results = pipe.execute(raise_on_error=False)
        except self._errors as exc:
            self._failed(exc)
            with self._lock:
                self.counters.skipped_writes += len(writes)
            return
        self._succeeded()
        written = sum(len(b) for b, r in zip(blobs, results, strict=True) if not isinstance(r, Exception))
        refused = [r for r in results if isinstance(r, Exception)]
        with self._lock:
            self.counters.bytes_written += written
            self.counters.skipped_writes += len(refused)
        if refused:
            logger.info("remote tier refused %d of %d chunks: %s", len(refused), len(writes), refused[0])

    # ------------------------------------------------------------ reading
    def fetch(
        self, namespace: str, symbols: Sequence[Hashable], first: int, last: int, need_snapshot: bool
    ) -> RemoteHit:
        """Load the longest run of stored chunks `first, first + 1, ... < last` of `symbols`, joined.

        One pipelined `EXISTS` finds how many are stored, one `MGET` loads them. A chunk that is
        missing, vanished since, belongs to another sequence or is corrupt ends the hit there
        (corrupt ones are deleted). With `need_snapshot` (recurrent models) the hit ends at the
        last chunk that carries the snapshot at its end.
        """
        if last <= first:
            return RemoteHit()
        if not self.available:
            return RemoteHit(error=reasons.REMOTE_UNAVAILABLE)
        keys = chunk_keys(namespace, symbols, self.chunk_len, last)
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys[first:]:
                pipe.exists(key)
            found = pipe.execute()
            stored = next((i for i, n in enumerate(found) if not n), len(found))
            blobs = list(self._client.mget(keys[first : first + stored])) if stored else []
        except self._errors as exc:
            self._failed(exc)
            return RemoteHit(error=reasons.REMOTE_UNAVAILABLE)
        self._succeeded()
        chunks: list[Segment] = []
        nbytes = 0
        for offset, blob in enumerate(blobs):
            index = first + offset
            if not isinstance(blob, bytes):
                break  # evicted between EXISTS and MGET: a shorter hit
            nbytes += len(blob)
            try:
                chunk = self._decode(blob, namespace, symbols, index, keys)
            except BadChunkError as exc:
                self._drop_bad(keys[index], exc)
                break
            if chunk is None:
                break
            chunks.append(chunk)
        if need_snapshot:
            while chunks and chunks[-1].end not in chunks[-1].snapshots:
                chunks.pop()
        with self._lock:
            self.counters.bytes_read += nbytes
            if chunks:
                self.counters.hits += 1
                self.counters.hit_tokens += len(chunks) * self.chunk_len
        return RemoteHit(_join(chunks) if chunks else None)

    def _drop_bad(self, key: str, exc: Exception) -> None:
        with self._lock:
            self.counters.errors += 1
        logger.warning("dropping remote prefix-cache chunk %s: %s", key, exc)
        with contextlib.suppress(self._redis_error):  # best effort; the server evicts it eventually
            self._client.delete(key)

    def _decode(
        self, blob: bytes, namespace: str, symbols: Sequence[Hashable], index: int, chain: Sequence[str]
    ) -> Segment | None:
        """Chunk `index` from `blob` as a host segment, or None when it belongs to another sequence.

        Raises:
            BadChunkError: the value is not a whole chunk of this format, or fails its checksum.
        """
        lo, hi = index * self.chunk_len, (index + 1) * self.chunk_len
        key = chain[index]
        try:
            meta = _read_meta(blob)
            tensors = load_tensors(blob)
        except Exception as exc:
            raise BadChunkError(f"unreadable value ({type(exc).__name__}: {exc})") from exc
        if meta.get("format") != FORMAT:
            raise BadChunkError(f"unknown format {meta.get('format')!r}")
        if meta.get("checksum") != checksum(tensors, {k: v for k, v in meta.items() if k != "checksum"}):
            raise BadChunkError("fails its checksum")
        expected_prev = _chain_of(chain[index - 1]) if index else _seed(namespace, self.chunk_len)
        same = (
            meta.get("namespace") == namespace
            and (meta.get("lo"), meta.get("hi")) == (lo, hi)
            and meta.get("prev") == expected_prev
            and meta.get("symbols") == [int(s) for s in symbols[lo:hi]]  # type: ignore[call-overload]
        )
        if not same:
            with self._lock:
                self.counters.errors += 1
            logger.warning(
                "remote chunk %s holds another sequence (a hash collision or a foreign writer); ignored", key
            )
            return None
        layout = self.layout
        if meta.get("layout") != _layout_json(layout):
            raise BadChunkError(f"layout {meta.get('layout')} does not fit the model's {_layout_json(layout)}")
        keys: list[torch.Tensor | None] = [tensors.get(f"k.{i}") for i in range(layout.num_layers)]
        values: list[torch.Tensor | None] = [tensors.get(f"v.{i}") for i in range(layout.num_layers)]
        for k, v in zip(keys, values, strict=True):
            if (k is None) != (v is None) or (k is not None and v is not None and k.shape[-2] != hi - lo):
                raise BadChunkError(f"keys/values do not cover {hi - lo} positions")
        if [i for i, k in enumerate(keys) if k is not None] != list(layout.kv_layers):
            raise BadChunkError(f"keys for other layers than the model's {layout.kv_layers}")
        devices = [torch.device(d) if d is not None else None for d in stored_devices(meta, layout.num_layers)]
        run = None
        if layout.kv_layers:
            run = Run(keys, values, lo, hi, devices=devices)
            run.take()
        stub = Segment(None, lo, hi, 0, disk=DiskRef(Path(key), lo, hi, devices))
        try:
            snapshots = states_from_file("s", meta.get("snapshots", {}), tensors, stub, layout.state_layers, Snapshot)
            items = states_from_file("i", meta.get("items", {}), tensors, stub, layout.item_layers, ItemState)
        except (CorruptFileError, KeyError, ValueError, TypeError) as exc:
            raise BadChunkError(f"bad states: {exc}") from exc
        if any(n != hi for n in snapshots):
            raise BadChunkError(f"snapshots at {sorted(snapshots)}, a chunk carries only the one at {hi}")
        nbytes_per_token = run.nbytes_per_token if run is not None else 0
        return Segment(run, lo, hi, nbytes_per_token, snapshots, items=items)


def _join(chunks: list[Segment]) -> Segment:
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
