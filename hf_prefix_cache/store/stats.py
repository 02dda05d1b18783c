"""CacheStats: what the store did, as an immutable snapshot for users and tests."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class CacheStats:
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

    def _repr_html_(self) -> str:
        from hf_prefix_cache.store.display import stats_html

        return stats_html(self)
