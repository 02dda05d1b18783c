"""StoreStats: what the store did, as an immutable snapshot (users get it as `CacheStats`, which renders it)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

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
    """A `StoreStats` of the `requests` counters, the tree's sizes and the placement's counters (under the lock).

    The counters `StoreStats` reports under their own names (the request counts, the placement's
    events, the remote tier's as ``remote_<name>``) are read by name, so a new one is a field on
    both sides.
    """
    c = requests.counts
    tier_nbytes, budgets = tree.tier_nbytes, placement.budgets
    values = {**_reported(c), **_reported(placement.counters)}
    if placement.remote is not None:
        values.update(_reported(placement.remote.counters, "remote_"))
    values["fallbacks"] = dict(c.fallbacks)  # a copy: the stats are a snapshot
    return StoreStats(
        **values,
        entries=tree.num_leaves,
        nodes=tree.num_nodes,
        nbytes=tree.total_nbytes,
        max_bytes=budgets[DEVICE],
        device_nbytes=tier_nbytes[DEVICE],
        host_nbytes=tier_nbytes[HOST],
        disk_nbytes=tier_nbytes[DISK],
        max_host_bytes=budgets[HOST],
        max_disk_bytes=budgets[DISK],
        snapshots=placement.counters.num_snapshots,
        encoder_entries=encoder_outputs.num_entries,
        encoder_nbytes=encoder_outputs.nbytes,
        max_encoder_bytes=encoder_outputs.max_bytes,
        encoder_hits=encoder_outputs.hits,
        hit_tokens_by_modality=requests.hit_by_modality(),
        saved_prefill_flops=requests.saved_prefill_flops(),
    )


_REPORTED = frozenset(f.name for f in fields(StoreStats))


def _reported(counters: Any, prefix: str = "") -> dict[str, Any]:
    """The fields of the dataclass `counters` that `StoreStats` reports, by their names there (`prefix` + name).

    >>> from hf_prefix_cache.store.placement_counters import PlacementCounters
    >>> sorted(_reported(PlacementCounters(offloads=2)).items())[:3]  # `disk_writes` is not reported
    [('evicted_bytes', 0), ('evictions', 0), ('failed_moves', 0)]
    """
    return {prefix + f.name: getattr(counters, f.name) for f in fields(counters) if prefix + f.name in _REPORTED}
