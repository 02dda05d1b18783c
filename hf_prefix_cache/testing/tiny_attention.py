"""Tiny attention-only causal LMs: full attention (MLA with an indexer included) and sliding or chunked layers.

Built as `tiny_build` describes; `tiny_models.TINY_MODELS` names them.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel

from hf_prefix_cache.testing.tiny_build import (
    _ATTN,
    _EXPERTS,
    _GATED_DELTA,
    _INDEXER,
    _MLA,
    _ROUTED_EXPERTS,
    WINDOW,
    lm,
    merged,
)

# --------------------------------------------------------------------------- full attention


def tiny_llama() -> PreTrainedModel:
    """Llama, 2 layers of full attention."""
    return lm("Llama", num_hidden_layers=2, **_ATTN)


def tiny_qwen3() -> PreTrainedModel:
    """Qwen3 (q/k-norm), 2 layers of full attention."""
    return lm("Qwen3", num_hidden_layers=2, head_dim=16, **_ATTN)


def tiny_phi3() -> PreTrainedModel:
    """Phi-3 (fused qkv / gate_up), 2 layers of full attention."""
    return lm("Phi3", num_hidden_layers=2, sliding_window=None, **_ATTN)


def tiny_gpt2() -> PreTrainedModel:
    """GPT-2 (learned absolute positions), 2 layers of full attention."""
    return lm("GPT2", "GPT2LMHeadModel", n_embd=64, n_layer=2, n_head=4, n_inner=128, n_positions=512)


def tiny_deepseek_v32() -> PreTrainedModel:
    """DeepSeek-V3.2, 2 layers of MLA with a sparse-attention indexer (`DynamicIndexedLayer`) keeping 256 keys
    per query (all of the tests' prompts); its keys are 18 wide over 4 heads, so they travel zero-padded in the stored values."""
    # index_topk 256 holds every key of the tests' prompts: past it a store runs cold (`indexer_top_k`).
    spec = merged(_ATTN, _MLA, _INDEXER, _ROUTED_EXPERTS, index_head_dim=18, n_group=1, topk_group=1)
    return lm("DeepseekV32", num_hidden_layers=2, first_k_dense_replace=1, **spec)


def tiny_glm_moe_dsa() -> PreTrainedModel:
    """GLM-5 (`glm_moe_dsa`), 2 layers of MLA with its own indexer (`DynamicIndexedLayer`) keeping 256 keys per query."""
    # indexer_types: each layer selects its own keys (none shares the one before).
    spec = merged(_ATTN, _MLA, _INDEXER, _ROUTED_EXPERTS, indexer_types=["full", "full"], first_k_dense_replace=1)
    return lm("GlmMoeDsa", num_hidden_layers=2, **spec)


def tiny_qwen4_exp() -> PreTrainedModel:
    """Qwen4-Exp text: a gated-delta-net layer, then attention whose indexer keeps 8 tokens' worth of 4-token
    blocks per query (`indexer_budget`, `indexer_compress_ratio`) plus the query's incomplete block."""
    # Few indexer heads make ReLU-zero ties common (each then runs cold: `indexer_tie`).
    indexer = {"indexer_n_heads": 8, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8}
    return lm(
        "Qwen4ExpText",
        "Qwen4ExpForCausalLM",
        **merged(_ATTN, _GATED_DELTA, _EXPERTS, indexer, indexer_compress_ratio=4, shared_expert_intermediate_size=32),
        num_hidden_layers=2,
        layer_types=["linear_attention", "indexed_attention"],
        head_dim=16,
    )


# --------------------------------------------------------------------------- sliding / chunked attention


def tiny_mistral() -> PreTrainedModel:
    """Mistral, 2 layers, all sliding-window attention (window 8)."""
    return lm("Mistral", num_hidden_layers=2, head_dim=16, sliding_window=WINDOW, **_ATTN)


#: Gemma 2 and Gemma 3's shared shape: 4 layers of 16-wide heads, window 8.
_GEMMA: dict[str, Any] = {
    "num_hidden_layers": 4,
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "sliding_window": WINDOW,
}


def tiny_gemma2() -> PreTrainedModel:
    """Gemma2, 4 layers alternating sliding (window 8) / full attention, with soft-capping."""
    return lm("Gemma2", layer_types=["sliding_attention", "full_attention"] * 2, **_GEMMA, **_ATTN)


def tiny_gemma3_text() -> PreTrainedModel:
    """Gemma3 text-only, 4 layers: 3 sliding (window 8) then 1 full attention."""
    return lm(
        "Gemma3Text", "Gemma3ForCausalLM", layer_types=["sliding_attention"] * 3 + ["full_attention"], **_GEMMA, **_ATTN
    )


def tiny_llama4_text() -> PreTrainedModel:
    """Llama4 text-only: 3 chunked (chunk 8, RoPE) + 1 full (NoPE) layers; 2-expert MoE on odd layers."""
    return lm(
        "Llama4Text",
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
