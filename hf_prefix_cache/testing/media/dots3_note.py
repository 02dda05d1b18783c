"""A tiny dots3 Note for the ``"thw"`` grid media tests (`grid.py` builds its media and cases).

Its vision tower (2-D RoPE, attention within each item, a routed-expert MLP per patch) reads flattened
2x2-pixel patch rows and merges 2x2 patches per placeholder; its text layers are MLA attention, an
indexed layer (its top-k above any test prompt's length) and a sliding one; audio goes unused here.
"""

from __future__ import annotations

from typing import Any

from hf_prefix_cache.testing.tiny_vlm_parts import _TEXT, _TOWER, vlm


def tiny_dots3_note() -> Any:
    """dots3 Note: a 2-layer expert ViT on 2x2-pixel patches, 2x2 merge; [indexed, sliding] MLA text layers."""
    experts = {"num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_layer_types": ["dense", "sparse"]}
    text = {
        **_TEXT,
        **experts,
        "num_key_value_heads": 4,
        "layer_types": ["indexed_attention", "sliding_attention"],
        "kv_lora_rank": 16,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
        "head_dim": 16,
        "n_routed_experts": 4,
        "shared_experts_intermediate_size": 32,
        "index_topk": 256,
        "index_head_dim": 16,
        "index_n_heads": 2,
        "sliding_window": 8,
        "per_layer_config": {},
    }
    vision = {
        **experts,
        **_TOWER,
        "patch_size": 2,
        "spatial_merge_size": 2,
        "num_local_experts": 4,
        "adapter_in_dim": 32,
        "adapter_out_dim": 64,
        "adapter_merge_size": 2,
        "per_layer_config": {},
    }
    audio = {
        **_TOWER,
        "num_hidden_layers": 1,
        "num_key_value_heads": 4,
        "head_dim": 8,
        "adapter_input_size": 32,
        "adapter_out_dim": 64,
        "downsample_hidden_size": 16,
        "feature_size": 16,
        "conv_output_size": 64,
    }
    return vlm(
        "Dots3Note", text_config=text, vision_config=vision, audio_config=audio, image_token_id=120, video_token_id=121
    )
