"""CacheStats: what the store did, as an immutable snapshot for users and tests."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Counters since the store was made (or `reset_stats`), plus its current size.

    `hit_tokens` counts prompt tokens served from the store, cumulative; `fallbacks` maps a
    reason (e.g. ``"beam_search"``) to how many requests ran cold because of it.
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
    snapshots: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens served from the store."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
