"""Shared helpers: tiny models, greedy generation with logits, cold-vs-cached comparison."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import settings

from hf_prefix_cache import _compat

sys.path.insert(0, str(Path(__file__).parent))

from tiny_models import TINY_MODELS, build, random_prompt  # noqa: E402

LOGIT_TOL = 1e-4
# The name this transformers release documents for the cache (`cache` from 5.24, `past_key_values` before):
# the shared helpers pass the store under it, so each of scripts/test's two runs covers its release's spelling.
CACHE_NAME = "cache" if _compat.CACHE_RENAMED else "past_key_values"

# On CI the property tests draw the same examples every run, so a red run is reproducible and a
# rare case found locally (random examples, as Hypothesis draws by default) becomes a test.
settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    settings.load_profile("ci")


@functools.cache
def cached_model(name: str) -> Any:
    """One instance per name per session (tests attach and detach stores on it)."""
    return build(name)


@pytest.fixture
def model_factory() -> Any:
    """Build a fresh tiny model by name."""
    return build


def kv_bytes_per_token(model: Any) -> int:
    """Bytes of float32 keys and values one token takes in every layer of `model`."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * 4


def distinct_prompt(seed: int, n: int = 30) -> torch.Tensor:
    """A random prompt whose first token depends on `seed`, so prompts of different seeds share no prefix."""
    ids = random_prompt(n, seed=seed)
    ids[0, 0] = 4 + seed % 120
    return ids


def generate(model: Any, ids: torch.Tensor, new: int = 6, **kwargs: Any) -> Any:
    """Greedy generation returning sequences and per-step logits."""
    kwargs.setdefault("attention_mask", torch.ones_like(ids))
    return model.generate(
        ids, max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True, **kwargs
    )


def max_logit_diff(a: Any, b: Any) -> float:
    assert len(a.logits) == len(b.logits)
    return max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits, strict=True))


def assert_same_as_cold(model: Any, ids: torch.Tensor, store: Any, new: int = 6, **kwargs: Any) -> Any:
    """Run cold and through `store`; assert equal tokens and logits within LOGIT_TOL. Returns the cached output."""
    cold = generate(model, ids, new, **kwargs)
    warm = generate(model, ids, new, **{CACHE_NAME: store}, **kwargs)
    assert torch.equal(cold.sequences, warm.sequences), f"tokens differ:\n{cold.sequences}\n{warm.sequences}"
    diff = max_logit_diff(cold, warm)
    assert diff < LOGIT_TOL, f"logits differ by {diff}"
    return warm


__all__ = [
    "CACHE_NAME",
    "LOGIT_TOL",
    "TINY_MODELS",
    "assert_same_as_cold",
    "cached_model",
    "distinct_prompt",
    "generate",
    "kv_bytes_per_token",
    "max_logit_diff",
    "random_prompt",
]


class Hits:
    """Hit tokens of a store's requests since the previous `last()` call."""

    def __init__(self, store: Any) -> None:
        self.store, self.seen = store, store.stats().hit_tokens

    def last(self) -> int:
        now = self.store.stats().hit_tokens
        hit, self.seen = now - self.seen, now
        return hit
