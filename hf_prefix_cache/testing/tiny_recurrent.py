"""Tiny causal LMs with recurrent state: hybrids of linear, conv or Mamba layers with attention, pure SSMs, module state.

Built as `tiny_build` describes; `tiny_models.TINY_MODELS` names them.

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
"""

from __future__ import annotations

from transformers import PreTrainedModel

from hf_prefix_cache.testing.tiny_build import (
    _ATTN,
    _EXPERTS,
    _GATED_DELTA,
    _INKLING_ATTENTION,
    _MAMBA1,
    _MAMBA2,
    _MAMBA_MIXER,
    _ROUTED_EXPERTS,
    WINDOW,
    lm,
)

# --------------------------------------------------------------------------- hybrid (linear + attention)


def tiny_jamba() -> PreTrainedModel:
    """Jamba, 4 layers [mamba, attn, mamba, attn]; MoE (2 experts) on odd layers."""
    return lm(
        "Jamba",
        num_hidden_layers=4,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=2,
        num_experts_per_tok=1,
        **_MAMBA_MIXER,
        **_ATTN,
    )


def tiny_bamba() -> PreTrainedModel:
    """Bamba, 3 layers [mamba2, attn, mamba2]."""
    return lm("Bamba", num_hidden_layers=3, attn_layer_indices=[1], **_MAMBA2, **_ATTN)


def tiny_zamba() -> PreTrainedModel:
    """Zamba, 6 layers: mamba, with a shared attention block on layers 1 and 4 (hybrid layers)."""
    return lm(
        "Zamba",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,
        attention_hidden_size=128,
        attention_head_dim=32,
        **_MAMBA_MIXER,
        mamba_dt_rank=8,
        n_mamba_heads=2,
        attn_layer_period=3,
        attn_layer_offset=1,
        max_position_embeddings=512,
        use_mamba_kernels=False,
    )


def tiny_qwen3_next() -> PreTrainedModel:
    """Qwen3-Next, 4 layers [gated-delta-net x3, full attn]; sparse MoE with 4 experts (top-2)."""
    return lm(
        "Qwen3Next",
        num_hidden_layers=4,
        head_dim=16,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        linear_conv_kernel_dim=4,
        shared_expert_intermediate_size=32,
        decoder_sparse_step=1,
        **_GATED_DELTA,
        **_EXPERTS,
        **_ATTN,
    )


def tiny_falcon_h1() -> PreTrainedModel:
    """Falcon-H1, 2 layers, each a parallel mamba2 + full-attention ("hybrid") block."""
    return lm("FalconH1", num_hidden_layers=2, mamba_d_ssm=128, **_MAMBA2, **_ATTN)


def tiny_lfm2() -> PreTrainedModel:
    """LFM2, 4 layers [conv, attn, conv, attn] (short gated convolutions + full attention)."""
    return lm(
        "Lfm2",
        num_hidden_layers=4,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
        conv_L_cache=3,
        block_auto_adjust_ff_dim=False,
        **_ATTN,
    )


def tiny_inkling() -> PreTrainedModel:
    """Inkling, 4 layers [hybrid sliding, hybrid, hybrid sliding, hybrid]: each a short conv plus attention
    (`LinearAttentionAndSlidingWindowAttentionLayer` with a window of 8, then `LinearAttentionAndFullAttentionLayer`)."""
    return lm(
        "InklingText",
        "InklingForCausalLM",
        num_hidden_layers=4,
        layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
        mlp_layer_types=["sparse"] * 4,
        **_INKLING_ATTENTION,
        **_ROUTED_EXPERTS,
        **_ATTN,
    )


# --------------------------------------------------------------------------- pure recurrent (cache_params)


def tiny_mamba() -> PreTrainedModel:
    """Mamba (v1), 2 layers, pure-torch selective scan."""
    return lm("Mamba", **_MAMBA1)


def tiny_falcon_mamba() -> PreTrainedModel:
    """Falcon-Mamba, 2 layers, pure-torch selective scan."""
    return lm("FalconMamba", **_MAMBA1)


def tiny_mamba2() -> PreTrainedModel:
    """Mamba2, 2 layers, pure-torch chunked SSD (chunk 16)."""
    return lm(
        "Mamba2",
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
    return lm(
        "RecurrentGemma",
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
