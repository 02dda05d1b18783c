"""How the front ends show a cached request's speedup: only when it reused tokens.

A request that reused nothing ran as a cold one did; a ratio of its two timings is noise, and
printing "1.2x" beside "reused 0" once hid a store that reused nothing at all (transformers
5.24's renamed cache argument). Such a request shows why it reused nothing instead.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

#: What a request that reused nothing and was not refused shows: nothing stored matched its start.
NOTHING_MATCHED = "nothing stored matched"


def speedup_text(reused_len: int, cold_s: float | None, cached_s: float, cold_reason: str | None = None) -> str:
    """`"3.2x"` for a request that reused tokens, else why it did not (``"none: <reason>"``).

    `cold_s` is None when the request was not timed without the store: no ratio then.

    >>> speedup_text(120, 0.30, 0.10)
    '3.0x'
    >>> speedup_text(0, 0.30, 0.25, "no_cache_argument")
    'none (ran cold: no_cache_argument)'
    >>> speedup_text(0, 0.30, 0.25)
    'none (nothing stored matched)'
    """
    if reused_len > 0 and cold_s is None:
        return "not timed cold"
    if reused_len > 0 and cold_s is not None and cached_s > 0:
        return f"{cold_s / cached_s:.1f}x"
    return f"none (ran cold: {cold_reason})" if cold_reason else f"none ({NOTHING_MATCHED})"


def new_fallbacks(before: Mapping[str, int], after: Mapping[str, int]) -> str | None:
    """The fallback reasons counted between two `fallbacks` readings (or in ``{}`` and a request's), joined, or None.

    >>> new_fallbacks({"padding": 1}, {"padding": 2, "empty_prompt": 1})
    'padding, empty_prompt'
    """
    reasons = [name for name, count in after.items() if count > before.get(name, 0)]
    return ", ".join(reasons) or None


def nothing_reused_warning(hit_tokens: int, fallbacks: Mapping[str, int]) -> str | None:
    """A loud line for a run in which the store reused no token at all, naming why; None otherwise.

    >>> nothing_reused_warning(0, {"no_cache_argument": 3})
    'WARNING: the store reused no token in this run (fallbacks: no_cache_argument x3)'
    """
    if hit_tokens > 0:
        return None
    why = ", ".join(f"{name} x{count}" for name, count in fallbacks.items()) or NOTHING_MATCHED
    return f"WARNING: the store reused no token in this run (fallbacks: {why})"


def busy_note(load: float | None = None, cores: int | None = None) -> str | None:
    """A line saying timings are noisy when the machine looked busy (1-minute load average above its cores).

    >>> busy_note(6.5, 2)
    'note: this machine looks busy (load average 6.5 on 2 cores): the times above are noisy'
    >>> busy_note(0.3, 2) is None
    True
    """
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:  # not every platform has a load average
            return None
    cores = cores or os.cpu_count() or 1
    if load <= cores:
        return None
    return f"note: this machine looks busy (load average {load:.1f} on {cores} cores): the times above are noisy"
