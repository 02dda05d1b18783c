"""Restores from snapshots, checked: requests run cold and through a store, each with the reuse it must get.

Models whose layers hold states (recurrences, compression windows, module-kept states) restore
only at a snapshot: at a stored answer's end, every `snapshot_interval` tokens, and where a
resumed request diverged. Their tests share two request streams: a second turn and its repeat
(`second_turn_and_repeat`), and divergences from what the store holds (`divergences`). Each request
is compared with a cold run (`assert_same_as_cold`: tokens equal, logits within `LOGIT_TOL`).

Example:
    >>> from hf_prefix_cache.testing.compare import served
    >>> from hf_prefix_cache.testing.tiny_models import build, random_prompt
    >>> model = build("llama")
    >>> with served(model) as store:
    ...     second_turn_and_repeat(model, store, random_prompt(12, seed=1), random_prompt(5, seed=2))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hf_prefix_cache.testing.compare import assert_same_as_cold

__all__ = ["divergences", "reuses", "second_turn_and_repeat"]


def reuses(model: Any, ids: torch.Tensor, store: Any, expected: int | None, new: int, **kwargs: Any) -> Any:
    """Run `ids` cold and through `store`; assert it reused `expected` tokens (None: any); return the cached run.

    `kwargs` go to `assert_same_as_cold` (`cache_argument`, generation kwargs).
    """
    before = int(store.stats().hit_tokens)
    out = assert_same_as_cold(model, ids, store, new, **kwargs)
    reused = int(store.stats().hit_tokens) - before
    if expected is not None and reused != expected:
        raise AssertionError(f"reused {reused} tokens, expected {expected}")
    return out


def second_turn_and_repeat(model: Any, store: Any, prompt: torch.Tensor, more: torch.Tensor, new: int = 4) -> None:
    """`prompt` reuses nothing; a second turn (its answer, then `more`) reuses up to the snapshot at the answer's end
    (all but the answer's last token, never fed); the turn's repeat all but its last token; nothing fell back."""
    first = reuses(model, prompt, store, 0, new)
    turn = torch.cat([first.sequences, more], 1)
    reuses(model, turn, store, first.sequences.shape[1] - 1, new)
    reuses(model, turn, store, turn.shape[1] - 1, new)
    if store.stats().fallbacks:
        raise AssertionError(f"fallbacks: {store.stats().fallbacks}")


def divergences(
    model: Any, store: Any, prompt: torch.Tensor, steps: Sequence[tuple[int, torch.Tensor, int]], new: int = 3
) -> None:
    """Run `prompt`, then each step's request; the last request's repeat reuses all but its last token.

    Args:
        model: The tiny model `store` serves.
        store: The store.
        prompt: The first request (its reuse is not checked).
        steps: (at, tail, expected) per request: the previous request's first `at` ids, then `tail`; it must
            reuse `expected` tokens (the snapshot its divergence at `at` restores).
        new: New tokens per request.
    """
    ids = prompt
    reuses(model, ids, store, None, new)
    for at, tail, expected in steps:
        ids = torch.cat([ids[:, :at], tail], 1)
        reuses(model, ids, store, expected, new)
    reuses(model, ids, store, ids.shape[1] - 1, new)
