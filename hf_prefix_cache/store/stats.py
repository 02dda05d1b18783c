"""StoreStats: what the store did, as an immutable snapshot (users get it as `CacheStats`, which renders it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hf_prefix_cache.storage.tiers import DEVICE, DISK, HOST

if TYPE_CHECKING:
    from hf_prefix_cache.storage.encoder_outputs import EncoderOutputs
    from hf_prefix_cache.storage.segments import Segment
    from hf_prefix_cache.store.counters import RequestCounters
    from hf_prefix_cache.store.placement import Placement
    from hf_prefix_cache.tree.radix import RadixTree


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counters since the store was made (or `reset_stats`), plus its current size.

    `hit_tokens` counts prompt tokens served from the store, cumulative; `fallbacks` maps a
    reason (e.g. ``"beam_search"``) to how many requests ran cold because of it. `nbytes` is
    the total over all tiers; `device_nbytes`, `host_nbytes` and `disk_nbytes` split it.
    `evictions` counts nodes dropped from the store, `offloads` moves to a slower tier,
    `reloads` entries brought back to the device for a hit, `expired` entries dropped by the
    ttl, `skipped_files` disk files found unusable, `failed_moves` moves to a slower tier that
    failed (a full or read-only disk, no host memory), whose entries stayed where they were.

    Encoder-decoder models keyed by their encoder input (Whisper) also keep encoder outputs,
    apart from the tree and its tiers: `encoder_entries` of them, `encoder_nbytes` bytes (not
    in `nbytes`) within `max_encoder_bytes`; `encoder_hits` counts requests that skipped the
    encoder.

    With a remote tier: `remote_hits` counts lookups that loaded chunks from the server
    (`remote_hit_tokens` their tokens), `remote_bytes_read` / `remote_bytes_written` the bytes
    of chunk values moved, `remote_errors` failed calls (server down, timeouts) and chunks
    dropped as corrupt or foreign, `remote_skipped_writes` chunks not written (server full or
    unreachable, or over `max_remote_bytes`).

    `hit_tokens_by_modality` splits `hit_tokens` by what the restored positions held
    (``"text"``, ``"image"``, ``"video"``, ``"audio"`` placeholders); `saved_prefill_flops` is
    an estimate of the language model's prefill work those hits spared (see `observe.py`).
    """

    requests: int = 0
    hit_requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    computed_tokens: int = 0
    entries: int = 0
    nodes: int = 0
    nbytes: int = 0
    max_bytes: int = 0
    device_nbytes: int = 0
    host_nbytes: int = 0
    disk_nbytes: int = 0
    max_host_bytes: int = 0
    max_disk_bytes: int = 0
    snapshots: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    offloads: int = 0
    reloads: int = 0
    expired: int = 0
    skipped_files: int = 0
    failed_moves: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)
    encoder_entries: int = 0
    encoder_nbytes: int = 0
    max_encoder_bytes: int = 0
    encoder_hits: int = 0
    remote_hits: int = 0
    remote_hit_tokens: int = 0
    remote_bytes_read: int = 0
    remote_bytes_written: int = 0
    remote_errors: int = 0
    remote_skipped_writes: int = 0
    hit_tokens_by_modality: dict[str, int] = field(default_factory=dict)
    saved_prefill_flops: int = 0

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens served from the store."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def collect_stats(
    requests: RequestCounters, tree: RadixTree[Segment], placement: Placement, encoder_outputs: EncoderOutputs
) -> StoreStats:
    """A `StoreStats` of the `requests` counters, the tree's sizes and the placement's counters (under the lock)."""
    c = requests.counts
    p = placement.counters
    tier_nbytes = tree.tier_nbytes
    return StoreStats(
        requests=c.requests,
        hit_requests=c.hit_requests,
        prompt_tokens=c.prompt_tokens,
        hit_tokens=c.hit_tokens,
        computed_tokens=c.computed_tokens,
        entries=tree.num_leaves,
        nodes=tree.num_nodes,
        nbytes=tree.total_nbytes,
        max_bytes=placement.budgets[DEVICE],
        device_nbytes=tier_nbytes[DEVICE],
        host_nbytes=tier_nbytes[HOST],
        disk_nbytes=tier_nbytes[DISK],
        max_host_bytes=placement.budgets[HOST],
        max_disk_bytes=placement.budgets[DISK],
        snapshots=p.num_snapshots,
        evictions=p.evictions,
        evicted_bytes=p.evicted_bytes,
        offloads=p.offloads,
        reloads=p.reloads,
        expired=c.expired,
        skipped_files=p.skipped_files,
        failed_moves=p.failed_moves,
        fallbacks=dict(c.fallbacks),
        encoder_entries=encoder_outputs.num_entries,
        encoder_nbytes=encoder_outputs.nbytes,
        max_encoder_bytes=encoder_outputs.max_bytes,
        encoder_hits=encoder_outputs.hits,
        hit_tokens_by_modality=requests.hit_by_modality(),
        saved_prefill_flops=requests.saved_prefill_flops(),
        **_remote_stats(placement),
    )


def _remote_stats(placement: Placement) -> dict[str, int]:
    remote = placement.remote
    if remote is None:
        return {}
    c = remote.counters
    return {
        "remote_hits": c.hits,
        "remote_hit_tokens": c.hit_tokens,
        "remote_bytes_read": c.bytes_read,
        "remote_bytes_written": c.bytes_written,
        "remote_errors": c.errors,
        "remote_skipped_writes": c.skipped_writes,
    }
