"""Cold versus cached: greedy generation with its logits, and the assertion that both runs agree.

The store is passed under the cache argument this transformers release documents (`cache` from
5.24, `past_key_values` before), so a run of the suite on each release covers its spelling.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from hf_prefix_cache import PrefixCache, _compat

LOGIT_TOL = 1e-4
#: The name this transformers release documents for the cache argument of `generate`.
CACHE_NAME = "cache" if _compat.CACHE_RENAMED else "past_key_values"


def generate(model: Any, ids: torch.Tensor, new: int = 6, **kwargs: Any) -> Any:
    """Greedy generation returning sequences and per-step logits."""
    kwargs.setdefault("attention_mask", torch.ones_like(ids))
    return model.generate(
        ids, max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs
    )


def max_logit_diff(a: Any, b: Any) -> float:
    """The largest absolute difference between the per-step logits of two `generate` outputs."""
    if len(a.logits) != len(b.logits):
        raise AssertionError(f"{len(a.logits)} steps of logits against {len(b.logits)}")
    return float(max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits, strict=True)))


def assert_same_as_cold(
    model: Any, ids: torch.Tensor, store: Any, new: int = 6, *, cache_argument: str = CACHE_NAME, **kwargs: Any
) -> Any:
    """Run cold and through `store`; assert equal tokens and logits within LOGIT_TOL. Returns the cached output.

    The store goes to `generate` under `cache_argument` (this release's documented name by default).
    """
    cold = generate(model, ids, new, **kwargs)
    warm = generate(model, ids, new, **{cache_argument: store}, **kwargs)
    assert_same_outputs(cold, warm)
    return warm


def assert_same_outputs(cold: Any, warm: Any) -> float:
    """Assert two `generate` outputs have equal tokens and logits within LOGIT_TOL; return the largest difference.

    Explicit raises, not `assert`: the comparison holds under ``python -O`` too (`tests/project/test_optimized.py`).
    """
    if not torch.equal(cold.sequences, warm.sequences):
        raise AssertionError(f"tokens differ:\n{cold.sequences}\n{warm.sequences}")
    diff = max_logit_diff(cold, warm)
    if not diff < LOGIT_TOL:
        raise AssertionError(f"logits differ by {diff}")
    return diff


class Hits:
    """Hit tokens of a store's requests since the previous `last()` call."""

    def __init__(self, store: Any) -> None:
        self.store, self.seen = store, int(store.stats().hit_tokens)

    def last(self) -> int:
        """Hit tokens since the previous call (or since this counter was made)."""
        now = int(self.store.stats().hit_tokens)
        hit, self.seen = now - self.seen, now
        return hit


@contextmanager
def served(model: Any, *, clean: bool = True, **options: Any) -> Iterator[PrefixCache]:
    """A store on `model` for one test; detached on exit.

    Args:
        model: The tiny model to attach to.
        clean: When the body ends without error, check the store's integrity and that nothing fell back.
        **options: `PrefixCache` options (`max_bytes`, `disk_dir`, `snapshot_interval`, ...).
    """
    store = PrefixCache(model, **options)
    try:
        yield store
        if clean:
            store.check_integrity()
            if store.stats().fallbacks:
                raise AssertionError(f"fallbacks: {store.stats().fallbacks}")
    finally:
        store.detach()
