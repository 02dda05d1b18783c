"""Configs of real checkpoints, written from their published `config.json` shapes (no download).

Used at full size with random weights (slow tests) and on the meta device (fast tests: every
size-dependent path at 8B and 70B without allocating a byte of weights).

- Llama-3.2-1B, Llama-3.1-8B, Llama-3.1-70B: meta-llama's configs (llama3 RoPE scaling).
- Qwen2.5-1.5B: Qwen's config (2 KV heads, tied embeddings, no sliding window in use).
- Gemma-3-1B (text): google/gemma-3-1b-it's text config: 26 layers, 5 sliding (window 512) then
  1 full, head_dim 256, 1 KV head, vocab 262,144.
- Mamba-130m: state-spaces/mamba-130m-hf (24 layers, d_model 768, state 16).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch
import transformers

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}


class _Llama3(NamedTuple):
    """What sets one Llama 3 checkpoint apart: its RoPE scaling factor, sizes and tied embeddings (8 KV heads each)."""

    factor: float
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    tie_word_embeddings: bool
    head_dim: int | None = None


_LLAMA3 = {
    "llama-3.2-1b": _Llama3(32.0, 2048, 8192, 16, 32, True, head_dim=64),
    "llama-3.1-8b": _Llama3(8.0, 4096, 14336, 32, 32, False),
    "llama-3.1-70b": _Llama3(8.0, 8192, 28672, 80, 64, False),
}


def _llama(name: str) -> Any:
    shape = _LLAMA3[name]
    rope = {**_LLAMA3_ROPE, "rope_theta": 500000.0, "factor": shape.factor, "original_max_position_embeddings": 8192}
    sizes = {k: v for k, v in shape._asdict().items() if k != "factor" and v is not None}
    return transformers.LlamaConfig(
        vocab_size=128256,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        bos_token_id=128000,
        eos_token_id=128001,
        rope_parameters=rope,
        num_key_value_heads=8,
        **sizes,
    )


def qwen2_5_1_5b() -> Any:
    return transformers.Qwen2Config(
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=131072,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        use_sliding_window=False,
        sliding_window=131072,
        max_window_layers=21,
        tie_word_embeddings=True,
        bos_token_id=151643,
        eos_token_id=151643,
    )


GEMMA3_WINDOW = 512


def gemma_3_1b_text() -> Any:
    return transformers.Gemma3TextConfig(
        vocab_size=262144,
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=GEMMA3_WINDOW,
        layer_types=[("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(26)],
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        tie_word_embeddings=True,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )


def mamba_130m() -> Any:
    return transformers.MambaConfig(
        vocab_size=50280,
        hidden_size=768,
        state_size=16,
        num_hidden_layers=24,
        expand=2,
        conv_kernel=4,
        time_step_rank=48,
        use_bias=False,
        use_conv_bias=True,
        residual_in_fp32=True,
        layer_norm_epsilon=1e-5,
        use_mambapy=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


# name -> (config builder, model class name)
REAL_CONFIGS: dict[str, tuple[Callable[[], Any], str]] = {
    "llama-3.2-1b": (partial(_llama, "llama-3.2-1b"), "LlamaForCausalLM"),
    "qwen2.5-1.5b": (qwen2_5_1_5b, "Qwen2ForCausalLM"),
    "gemma-3-1b": (gemma_3_1b_text, "Gemma3ForCausalLM"),
    "mamba-130m": (mamba_130m, "MambaForCausalLM"),
    "llama-3.1-8b": (partial(_llama, "llama-3.1-8b"), "LlamaForCausalLM"),
    "llama-3.1-70b": (partial(_llama, "llama-3.1-70b"), "LlamaForCausalLM"),
}


def build_real(name: str, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> Any:
    """The model `name` with random weights (seed 0) in `dtype`; `device="meta"` allocates nothing.

    Greedy generation never stops early (`eos_token_id` is None), as in `tiny_models`.
    """
    make_config, class_name = REAL_CONFIGS[name]
    config = make_config()
    config._attn_implementation = "eager" if config.model_type in ("mamba", "gemma3_text") else "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, class_name)._from_config(config, dtype=dtype)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.generation_config.do_sample = False
    return model
