"""Factory of tiny random-weight causal-LM models for the test-suite.

The models are built as `tiny_build` describes (float32, eager attention, generation that never
stops early); attention-only ones are in `tiny_attention`, those with recurrent state (and the
transformers quirks they expose) in `tiny_recurrent`. This module names them, groups them by
cache layer type, and builds prompts for them.

Usage::

    model = build("mistral")
    prompt = random_prompt(60)
    out = model.generate(prompt, max_new_tokens=8, do_sample=False)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from hf_prefix_cache.testing.tiny_attention import (
    tiny_deepseek_v32,
    tiny_gemma2,
    tiny_gemma3_text,
    tiny_gpt2,
    tiny_llama,
    tiny_llama4_text,
    tiny_mistral,
    tiny_phi3,
    tiny_qwen3,
)
from hf_prefix_cache.testing.tiny_build import VOCAB_SIZE
from hf_prefix_cache.testing.tiny_recurrent import (
    tiny_bamba,
    tiny_falcon_h1,
    tiny_falcon_mamba,
    tiny_inkling,
    tiny_jamba,
    tiny_lfm2,
    tiny_mamba,
    tiny_mamba2,
    tiny_qwen3_next,
    tiny_recurrent_gemma,
    tiny_zamba,
)

TINY_MODELS: dict[str, Callable[[], PreTrainedModel]] = {
    "llama": tiny_llama,
    "qwen3": tiny_qwen3,
    "phi3": tiny_phi3,
    "gpt2": tiny_gpt2,
    "deepseek_v32": tiny_deepseek_v32,
    "mistral": tiny_mistral,
    "gemma2": tiny_gemma2,
    "gemma3_text": tiny_gemma3_text,
    "llama4_text": tiny_llama4_text,
    "jamba": tiny_jamba,
    "bamba": tiny_bamba,
    "zamba": tiny_zamba,
    "qwen3_next": tiny_qwen3_next,
    "falcon_h1": tiny_falcon_h1,
    "lfm2": tiny_lfm2,
    "inkling_text": tiny_inkling,
    "mamba2": tiny_mamba2,
    "mamba": tiny_mamba,
    "falcon_mamba": tiny_falcon_mamba,
    "recurrent_gemma": tiny_recurrent_gemma,
}

#: Models with plain (per-token) attention caches only.
FULL_ATTENTION = ("llama", "qwen3", "phi3", "gpt2", "deepseek_v32")
#: Models whose cache has sliding-window or chunked attention layers.
SLIDING = ("mistral", "gemma2", "gemma3_text", "llama4_text")
#: Hybrid models: linear/conv/mamba layers plus attention layers, cache under ``past_key_values``.
HYBRID = ("jamba", "bamba", "zamba", "qwen3_next", "falcon_h1", "lfm2", "inkling_text")
#: Pure recurrent models, cache passed/returned as ``cache_params``.
RECURRENT = ("mamba2", "mamba", "falcon_mamba")
#: Models keeping recurrent state inside modules (not in the Cache object).
MODULE_STATE = ("recurrent_gemma",)


def build(name: str) -> PreTrainedModel:
    """Build the tiny model registered under ``name`` (see :data:`TINY_MODELS`)."""
    try:
        factory = TINY_MODELS[name]
    except KeyError:
        raise KeyError(f"unknown tiny model {name!r}; known: {sorted(TINY_MODELS)}") from None
    return factory()


def random_prompt(n: int, vocab: int = 100, seed: int = 0) -> torch.LongTensor:
    """Return a ``[1, n]`` LongTensor of ids in ``[4, min(vocab, VOCAB_SIZE))`` (no special ids)."""
    high = min(vocab, VOCAB_SIZE)
    if high <= 4:
        raise ValueError(f"vocab must be > 4, got {vocab}")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, high, (1, n), generator=gen, dtype=torch.long)  # type: ignore[return-value]
