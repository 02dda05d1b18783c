"""Factory of tiny random-weight causal-LM models for the test-suite.

Every model is built from its config class (no hub access), seeded with ``torch.manual_seed(0)``,
put in ``eval()`` mode, float32, with ``attn_implementation="eager"``: ``"sdpa"`` is rejected at build
time by Gemma2, Mamba, Mamba2 and FalconMamba, while eager works for every model here.
Sizes are chosen so that a 20-token greedy generate on a ~60-token prompt runs in well under a
second on 2 CPU cores.

Generation never stops early: ``eos_token_id`` is ``None`` in both the config and the generation
config, so ``generate(..., max_new_tokens=n)`` always yields exactly ``n`` new tokens.

Known transformers quirks these models expose (5.x, pure-torch paths):

* ``mamba`` / ``falcon_mamba``: a multi-token forward on top of an existing ``cache_params`` restarts the
  selective scan from a zero SSM state (only ``seq_len == 1`` steps use the cached state); so does
  ``jamba``'s. The store continues the scan itself on its working caches (``hf_prefix_cache/scan.py``).
  ``mamba2`` and the other hybrids continue correctly.
* ``bamba``: the model defaults ``position_ids`` to ``arange(seq_len)`` ignoring the cache; pass explicit
  ``position_ids`` when continuing from a cache outside ``generate``.
* ``recurrent_gemma``: the RG-LRU/conv state lives in the modules (``_setup_cache``), not in the Cache; the
  forward output has no ``past_key_values``.
* Random weights can emit the special ids 0-3 during generation.

Usage::

    model = build("mistral")
    prompt = random_prompt(60)
    out = model.generate(prompt, max_new_tokens=8, do_sample=False)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import transformers
from transformers import PreTrainedConfig, PreTrainedModel

#: Vocabulary size shared by all tiny models.
VOCAB_SIZE = 128
#: Sliding-window / attention-chunk size; shorter than the prompts used in tests (~40-80 tokens).
WINDOW = 8
#: Attention implementation used for every model.
ATTN_IMPLEMENTATION = "eager"
#: Special token ids (all below 4, never produced by :func:`random_prompt`).
PAD_ID, BOS_ID = 0, 1

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "pad_token_id": PAD_ID,
    "bos_token_id": BOS_ID,
    "eos_token_id": None,
    "tie_word_embeddings": False,
}

# Decoder-only transformer sizes (hidden 64, 4 heads of 16, 2 KV heads).
_ATTN: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}

# Mamba-2 style mixer sizes (d_inner = 2 * 64 = 128 = 8 heads * 16).
_MAMBA2: dict[str, Any] = {
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_n_groups": 1,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 16,
}


def _finalize(model: PreTrainedModel) -> PreTrainedModel:
    """Put ``model`` in eval/float32 mode and make greedy generation run to ``max_new_tokens``."""
    model = model.to(torch.float32).eval()  # type: ignore[arg-type]
    gen = model.generation_config
    gen.eos_token_id = None
    gen.pad_token_id = PAD_ID
    gen.bos_token_id = BOS_ID
    gen.do_sample = False
    gen.max_length = None
    gen.min_new_tokens = None
    gen.temperature = None
    gen.top_p = None
    gen.top_k = None
    return model


def _make(config_cls: type[PreTrainedConfig], model_cls_name: str, **kwargs: object) -> PreTrainedModel:
    """Seed, build ``model_cls_name`` from ``config_cls(**_COMMON, **kwargs)`` and finalize it."""
    torch.manual_seed(0)
    config = config_cls(**{**_COMMON, **kwargs})
    model = transformers.AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        config, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.float32
    )
    if type(model).__name__ != model_cls_name:
        raise TypeError(f"expected {model_cls_name}, AutoModelForCausalLM built {type(model).__name__}")
    return _finalize(model)


# --------------------------------------------------------------------------- full attention


def tiny_llama() -> PreTrainedModel:
    """Llama, 2 layers of full attention."""
    return _make(transformers.LlamaConfig, "LlamaForCausalLM", num_hidden_layers=2, **_ATTN)


def tiny_qwen3() -> PreTrainedModel:
    """Qwen3 (q/k-norm), 2 layers of full attention."""
    return _make(transformers.Qwen3Config, "Qwen3ForCausalLM", num_hidden_layers=2, head_dim=16, **_ATTN)


def tiny_phi3() -> PreTrainedModel:
    """Phi-3 (fused qkv / gate_up), 2 layers of full attention."""
    return _make(transformers.Phi3Config, "Phi3ForCausalLM", num_hidden_layers=2, sliding_window=None, **_ATTN)


def tiny_gpt2() -> PreTrainedModel:
    """GPT-2 (learned absolute positions), 2 layers of full attention."""
    return _make(
        transformers.GPT2Config,
        "GPT2LMHeadModel",
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_inner=128,
        n_positions=512,
    )


# --------------------------------------------------------------------------- sliding / chunked attention


def tiny_mistral() -> PreTrainedModel:
    """Mistral, 2 layers, all sliding-window attention (window 8)."""
    return _make(
        transformers.MistralConfig,
        "MistralForCausalLM",
        num_hidden_layers=2,
        head_dim=16,
        sliding_window=WINDOW,
        **_ATTN,
    )


def tiny_gemma2() -> PreTrainedModel:
    """Gemma2, 4 layers alternating sliding (window 8) / full attention, with soft-capping."""
    return _make(
        transformers.Gemma2Config,
        "Gemma2ForCausalLM",
        num_hidden_layers=4,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
        **_ATTN,
    )


def tiny_gemma3_text() -> PreTrainedModel:
    """Gemma3 text-only, 4 layers: 3 sliding (window 8) then 1 full attention."""
    return _make(
        transformers.Gemma3TextConfig,
        "Gemma3ForCausalLM",
        num_hidden_layers=4,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        **_ATTN,
    )


def tiny_llama4_text() -> PreTrainedModel:
    """Llama4 text-only: 3 chunked (chunk 8, RoPE) + 1 full (NoPE) layers; 2-expert MoE on odd layers."""
    return _make(
        transformers.Llama4TextConfig,
        "Llama4ForCausalLM",
        num_hidden_layers=4,
        head_dim=16,
        intermediate_size=64,
        intermediate_size_mlp=128,
        num_local_experts=2,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        no_rope_layers=[1, 1, 1, 0],
        attention_chunk_size=WINDOW,
        layer_types=["chunked_attention", "chunked_attention", "chunked_attention", "full_attention"],
        **{k: v for k, v in _ATTN.items() if k != "intermediate_size"},
    )


# --------------------------------------------------------------------------- hybrid (linear + attention)


def tiny_jamba() -> PreTrainedModel:
    """Jamba, 4 layers [mamba, attn, mamba, attn]; MoE (2 experts) on odd layers."""
    return _make(
        transformers.JambaConfig,
        "JambaForCausalLM",
        num_hidden_layers=4,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=2,
        num_experts_per_tok=1,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        **_ATTN,
    )


def tiny_bamba() -> PreTrainedModel:
    """Bamba, 3 layers [mamba2, attn, mamba2]."""
    return _make(
        transformers.BambaConfig,
        "BambaForCausalLM",
        num_hidden_layers=3,
        attn_layer_indices=[1],
        **_MAMBA2,
        **_ATTN,
    )


def tiny_zamba() -> PreTrainedModel:
    """Zamba, 6 layers: mamba, with a shared attention block on layers 1 and 4 (hybrid layers)."""
    return _make(
        transformers.ZambaConfig,
        "ZambaForCausalLM",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,
        attention_hidden_size=128,
        attention_head_dim=32,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=8,
        n_mamba_heads=2,
        attn_layer_period=3,
        attn_layer_offset=1,
        max_position_embeddings=512,
        use_mamba_kernels=False,
    )


def tiny_qwen3_next() -> PreTrainedModel:
    """Qwen3-Next, 4 layers [gated-delta-net x3, full attn]; sparse MoE with 4 experts (top-2)."""
    return _make(
        transformers.Qwen3NextConfig,
        "Qwen3NextForCausalLM",
        num_hidden_layers=4,
        head_dim=16,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        decoder_sparse_step=1,
        **_ATTN,
    )


def tiny_falcon_h1() -> PreTrainedModel:
    """Falcon-H1, 2 layers, each a parallel mamba2 + full-attention ("hybrid") block."""
    return _make(
        transformers.FalconH1Config,
        "FalconH1ForCausalLM",
        num_hidden_layers=2,
        mamba_d_ssm=128,
        **_MAMBA2,
        **_ATTN,
    )


def tiny_lfm2() -> PreTrainedModel:
    """LFM2, 4 layers [conv, attn, conv, attn] (short gated convolutions + full attention)."""
    return _make(
        transformers.Lfm2Config,
        "Lfm2ForCausalLM",
        num_hidden_layers=4,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
        conv_L_cache=3,
        block_auto_adjust_ff_dim=False,
        **_ATTN,
    )


def tiny_inkling() -> PreTrainedModel:
    """Inkling, 4 layers [hybrid sliding, hybrid, hybrid sliding, hybrid]: each a short conv plus attention
    (`LinearAttentionAndSlidingWindowAttentionLayer` with a window of 8, then `LinearAttentionAndFullAttentionLayer`)."""
    return _make(
        transformers.InklingTextConfig,
        "InklingForCausalLM",
        num_hidden_layers=4,
        layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
        mlp_layer_types=["sparse"] * 4,
        head_dim=16,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=16,
        sliding_window_size=8,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        **_ATTN,
    )


def tiny_deepseek_v32() -> PreTrainedModel:
    """DeepSeek-V3.2, 2 layers of MLA with a sparse-attention indexer (`DynamicIndexedLayer`) keeping 256 keys
    per query (all of the tests' prompts); its keys are 18 wide over 4 heads, so they travel zero-padded in the stored values."""
    return _make(
        transformers.DeepseekV32Config,
        "DeepseekV32ForCausalLM",
        num_hidden_layers=2,
        num_key_value_heads=4,
        head_dim=8,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        index_topk=256,  # every key of the tests' prompts: past it a store runs cold (`indexer_top_k`)
        index_n_heads=8,
        index_head_dim=18,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        **{k: v for k, v in _ATTN.items() if k != "num_key_value_heads"},
    )


# --------------------------------------------------------------------------- pure recurrent (cache_params)


def tiny_mamba() -> PreTrainedModel:
    """Mamba (v1), 2 layers, pure-torch selective scan."""
    return _make(
        transformers.MambaConfig,
        "MambaForCausalLM",
        hidden_size=64,
        state_size=8,
        num_hidden_layers=2,
        expand=2,
        conv_kernel=4,
        use_mambapy=False,
    )


def tiny_falcon_mamba() -> PreTrainedModel:
    """Falcon-Mamba, 2 layers, pure-torch selective scan."""
    return _make(
        transformers.FalconMambaConfig,
        "FalconMambaForCausalLM",
        hidden_size=64,
        state_size=8,
        num_hidden_layers=2,
        expand=2,
        conv_kernel=4,
        use_mambapy=False,
    )


def tiny_mamba2() -> PreTrainedModel:
    """Mamba2, 2 layers, pure-torch chunked SSD (chunk 16)."""
    return _make(
        transformers.Mamba2Config,
        "Mamba2ForCausalLM",
        hidden_size=64,
        num_heads=8,
        head_dim=16,
        n_groups=1,
        state_size=16,
        num_hidden_layers=2,
        expand=2,
        conv_kernel=4,
        chunk_size=16,
    )


# --------------------------------------------------------------------------- module-state recurrence


def tiny_recurrent_gemma() -> PreTrainedModel:
    """RecurrentGemma, layers [recurrent, recurrent, local attn (window 8)]; RG-LRU state is module state."""
    return _make(
        transformers.RecurrentGemmaConfig,
        "RecurrentGemmaForCausalLM",
        num_hidden_layers=3,
        hidden_size=64,
        intermediate_size=128,
        lru_width=64,
        num_attention_heads=4,
        num_key_value_heads=1,
        attention_window_size=WINDOW,
        conv1d_width=4,
        block_types=["recurrent", "recurrent", "attention"],
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
