"""The remote tier: fixed-length chunks of stored prefixes in Redis (or Valkey), shared by processes and machines.

Below the last local tier. A chunk holds positions `[i * chunk_len, (i + 1) * chunk_len)` of one
symbol sequence (token ids and media symbols): their keys/values, the recurrent snapshot taken
exactly at its end (if any) and the item states of media placeholders ending inside it. Only
whole chunks are stored; a sequence's last partial chunk stays local.

How a chunk is keyed and encoded, and checked when loaded (a hash collision or a foreign writer
is a miss, never a wrong hit), is `remote_format.py`.

The server evicts (`maxmemory` with `allkeys-lru`); a chunk that vanished between lookup and
load makes the hit shorter. A server that is down, slow or full never fails a request: calls are
bounded by `timeout`, after a connection error the tier is skipped for a growing back-off (1 s
up to 30 s) and the client reconnects by itself; the caller counts the reason.

`RemoteTier` is a `Tier` (`tier.py`) and its work is the protocol's verbs. `put(seg, place)`
queues the whole chunks of the place's sequence that the server lacks (one pipelined `EXISTS`
round trip; chunks made by `remote_chunks.py`); `flush` sends them (one pipelined `SET` round
trip), called outside the store's lock; the caller holds nothing for them. `get(seg, place)` loads
the longest run of stored chunks of the range `seg` names (one pipelined `EXISTS`, then one
`MGET`) as one host segment, and `drop` gives back such a segment when the caller keeps none of
it (the server's copy stays: the server evicts).

Knows segments and the server; nothing about the tree.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit, urlunsplit

from hf_prefix_cache.storage.codec import CorruptFileError, Layout
from hf_prefix_cache.storage.remote_chunks import gather_chunks
from hf_prefix_cache.storage.remote_format import BadChunkError, ChunkWrite, chunk_keys, decode_chunk, join_chunks
from hf_prefix_cache.storage.segments import Segment
from hf_prefix_cache.storage.tier import Place

if TYPE_CHECKING:
    from collections.abc import Hashable, Sequence

    from hf_prefix_cache.storage.tier import Tier

logger = logging.getLogger("hf_prefix_cache")

_SCHEMES = ("redis", "rediss", "unix")
#: A Redis (or Valkey) Cluster: any one node's address; the client learns the others and each slot's master.
_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_MAX_BACKOFF = 30.0


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


class RemoteUnavailableError(Exception):
    """The server could not be asked (down, slow, refused, or backing off after such an error)."""


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
        url: ``redis://[user:password@]host:port/db``, ``rediss://...`` (TLS), ``unix://path``, or for a Redis
            (or Valkey) Cluster ``redis+cluster://[user:password@]host:port`` (``rediss+cluster://`` with TLS): any
            one node; keys are routed to their slots' masters, and a master that is down makes misses.
        layout: what a chunk must hold to fit the model (layers with keys, states, item states).
        chunk_len: symbols per chunk.
        ttl: seconds a written chunk lives on the server (None: until the server evicts it).
        timeout: seconds any one call may wait for the server (connect, read, write).
        max_write_bytes: the most bytes one entry may write (None: no limit).

    Raises:
        ValueError: for a URL of another scheme.
        ImportError: when the `redis` package is missing (``pip install 'redis[hiredis]'``, the ``[remote]`` extra).

    Example:
        >>> tier = RemoteTier("redis://localhost:6379/0", layout)  # doctest: +SKIP
        >>> tier.get(Segment(None, 0, 1024, 0), Standalone(namespace, symbols[:1024])).end  # doctest: +SKIP
        1024
    """

    name = "remote"

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
        scheme = urlsplit(url).scheme
        if scheme not in _SCHEMES and scheme not in _CLUSTER_SCHEMES:
            raise ValueError(
                f"remote must be a redis://, rediss://, unix:// or redis+cluster:// URL, got {redact(url)!r} "
                "(e.g. remote='redis://localhost:6379/0', or remote='redis+cluster://node:7000' for a cluster)"
            )
        try:
            import redis
            import redis.cluster
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "the remote tier needs the redis client: pip install 'redis[hiredis]' (the [remote] extra)"
            ) from exc
        self.url = redact(url)
        self.layout = layout
        self.chunk_len = chunk_len
        self.ttl = ttl
        self.max_write_bytes = max_write_bytes
        # One retry on a connection error: a pooled connection left over from before a server
        # restart fails once, then reconnects. A timeout is not retried: one timeout per call.
        common = {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "retry": Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
            "socket_read_size": 1 << 20,  # chunk values are megabytes: 32 KiB reads cost a Python call each
        }
        self.is_cluster = scheme in _CLUSTER_SCHEMES
        self._connect: Any
        if self.is_cluster:
            # Each chunk key is its own slot (no hash tags: one model's chunks spread over every master);
            # the cluster client routes each command of a pipeline to its slot's master, one batch per node.
            plain = urlunsplit((_CLUSTER_SCHEMES[scheme], *urlsplit(url)[1:]))
            self._connect = lambda: redis.cluster.RedisCluster.from_url(plain, **common)
        else:
            self._connect = lambda: redis.Redis.from_url(url, health_check_interval=30, **common)
        self._connected: Any = None
        # Any server-side or transport error (down, timeout, AUTH refused, a command refused) disables
        # the tier for a back-off; none reaches the request.
        self._errors = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError)
        if not self.is_cluster:
            self._connected = self._connect()  # connects on first use
        self._redis_error = redis.exceptions.RedisError
        self.counters = RemoteCounters()
        self._lock = threading.Lock()  # counters, back-off and the write queue; never held over I/O
        self._pending: list[ChunkWrite] = []
        self._down_until = 0.0
        self._backoff = 1.0
        self._down = False
        self._warned = False

    @property
    def _client(self) -> Any:
        """The client; a cluster's is made on first use (it asks a node for the slots), and again after a failure."""
        if self._connected is None:
            self._connected = self._connect()
        return self._connected

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
        if self.is_cluster:
            self._connected = None  # learn the slots again when the back-off ends (a master may have moved)
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

    # ------------------------------------------------------------ the tier's verbs
    def put(self, seg: Segment, place: Place) -> None:
        """Queue the whole chunks of `place`'s sequence (ending with `seg`) that the server lacks.

        Costs one `EXISTS` round trip; segments on disk are read only for missing chunks. The
        writes go out at the next `flush`; a sequence with symbols other than ints is not written.
        """
        symbols = place.symbols()
        num_chunks = len(symbols) // self.chunk_len
        if num_chunks == 0 or any(type(s) is not int for s in symbols):
            return None
        namespace = place.namespace
        missing = self._missing(namespace, symbols, num_chunks)
        if not missing:
            return None
        chain = chunk_keys(namespace, symbols, self.chunk_len, num_chunks)
        try:
            writes = gather_chunks(self.layout, self.chunk_len, place, symbols, chain, missing)
        except CorruptFileError as exc:
            logger.warning("not writing a prefix to the remote tier: %s", exc)
            return None
        self._queue(writes)
        return None

    def get(self, seg: Segment, place: Place) -> Segment:
        """The longest run of stored chunks of `place`'s sequence from `seg.start` on, up to `seg.end`, joined.

        `seg` names the range wanted (its ends on chunk boundaries; it holds nothing). One pipelined
        `EXISTS` finds how many chunks are stored, one `MGET` loads them, joined into one host
        segment. A chunk that is missing, vanished since, belongs to another sequence or is corrupt
        ends it there (corrupt ones are deleted). For a model with state layers it ends at the last
        chunk that carries the snapshot at its end. Nothing stored: an empty segment at `seg.start`.

        Raises:
            RemoteUnavailableError: the server could not be asked (the tier backs off before asking again).
        """
        first, last = seg.start // self.chunk_len, seg.end // self.chunk_len
        if last <= first:
            return Segment(None, seg.start, seg.start, 0)
        if not self.available:
            raise RemoteUnavailableError(f"{self.url} is backing off")
        namespace, symbols = place.namespace, place.symbols()
        keys = chunk_keys(namespace, symbols, self.chunk_len, last)
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys[first:]:
                pipe.exists(key)
            found = pipe.execute()
            stored = next((i for i, n in enumerate(found) if not n), len(found))
            blobs = self._load(keys[first : first + stored]) if stored else []
        except self._errors as exc:
            self._failed(exc)
            raise RemoteUnavailableError(f"{self.url}: {type(exc).__name__}: {exc}") from exc
        self._succeeded()
        chunks = self._decode(namespace, symbols, keys, first, blobs)
        if self.layout.state_layers:  # a restore needs the snapshot at the hit's end
            while chunks and chunks[-1].end not in chunks[-1].snapshots:
                chunks.pop()
        if chunks:
            with self._lock:
                self.counters.hits += 1
                self.counters.hit_tokens += len(chunks) * self.chunk_len
        return join_chunks(chunks) if chunks else Segment(None, seg.start, seg.start, 0)

    def drop(self, seg: Segment) -> None:
        """Give back a segment `get` loaded that the caller keeps none of (its run); the server's copy stays."""
        if seg.run is not None:
            seg.run.give_back(seg.start, seg.end)

    # ------------------------------------------------------------ what put and flush do
    def _missing(self, namespace: str, symbols: Sequence[Hashable], num_chunks: int) -> list[int]:
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

    def _queue(self, writes: Sequence[ChunkWrite]) -> None:
        """Hold `writes` for the next `flush`, unless together they exceed `max_write_bytes` (then counted, skipped)."""
        total = sum(w.nbytes for w in writes)
        with self._lock:
            if self.max_write_bytes is not None and total > self.max_write_bytes:
                self.counters.skipped_writes += len(writes)
                logger.info("not writing %d bytes to the remote tier: over max_remote_bytes", total)
                return
            self._pending.extend(writes)

    def flush(self) -> None:
        """Send the chunks `put` queued in one pipelined round trip (outside the store's lock); a full server skips
        (and counts) them."""
        with self._lock:
            writes, self._pending = self._pending, []
        if not writes:
            return
        if not self.available:
            with self._lock:
                self.counters.skipped_writes += len(writes)
            return
        blobs = [w.blob() for w in writes]
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
    def _decode(
        self, namespace: str, symbols: Sequence[Hashable], keys: Sequence[str], first: int, blobs: Sequence[Any]
    ) -> list[Segment]:
        """The chunks `first, first + 1, ...` loaded as `blobs`, up to the first that is gone, foreign or corrupt."""
        chunks: list[Segment] = []
        nbytes = 0
        for offset, blob in enumerate(blobs):
            index = first + offset
            if not isinstance(blob, bytes):
                break  # evicted between EXISTS and MGET: a shorter hit
            nbytes += len(blob)
            try:
                chunk = decode_chunk(self.layout, self.chunk_len, blob, namespace, symbols, index, keys)
            except BadChunkError as exc:
                self._drop_bad(keys[index], exc)
                break
            if chunk is None:  # another sequence's chunk (a hash collision or a foreign writer)
                with self._lock:
                    self.counters.errors += 1
                break
            chunks.append(chunk)
        with self._lock:
            self.counters.bytes_read += nbytes
        return chunks

    def _load(self, keys: Sequence[str]) -> list[Any]:
        """The values of `keys`: one `MGET` on a single server; on a cluster one pipelined batch of `GET`s per master
        (a multi-key command cannot span slots)."""
        if not self.is_cluster:
            return list(self._client.mget(keys))
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        return list(pipe.execute())

    def _drop_bad(self, key: str, exc: Exception) -> None:
        with self._lock:
            self.counters.errors += 1
        logger.warning("dropping remote prefix-cache chunk %s: %s", key, exc)
        with contextlib.suppress(self._redis_error):  # best effort; the server evicts it eventually
            self._client.delete(key)


if TYPE_CHECKING:
    _IS_A_TIER: type[Tier] = RemoteTier  # mypy checks that the remote tier speaks the protocol
