"""Tiny models of the generic families whose images are tiles or crops, a fixed number of placeholders each.

InternVL, Qianfan-OCR, Cohere 2 Vision, Aya Vision, Aria (crops with a pixel mask) and Llama 4.
Each is built from its config classes (float32, eager, seed 0); `generic_models` names them.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

from hf_prefix_cache.testing.media.generic_ids import IMG
from hf_prefix_cache.testing.tiny_build import _finalize
from hf_prefix_cache.testing.tiny_vlm_parts import _CLIP, _SIGLIP, _TEXT, _TOWER, text_config, vlm


def tiny_internvl() -> Any:
    """InternVL: 32x32 tiles, pixel shuffle 0.5: 4 placeholders per tile."""
    vision = {
        **_TOWER,
        "image_size": [32, 32],
        "patch_size": [8, 8],
    }
    return vlm(
        "InternVL", text_config=text_config("qwen2"), vision_config=vision, image_token_id=IMG, image_seq_length=4
    )


def tiny_qianfan_ocr() -> Any:
    """Qianfan-OCR: InternVL's layout, Qwen 3 text: 4 placeholders per tile."""
    vision = {
        **_TOWER,
        "image_size": [32, 32],
        "patch_size": [8, 8],
    }
    return vlm(
        "QianfanOCR",
        text_config=text_config("qwen3", head_dim=16),
        vision_config=vision,
        image_token_id=IMG,
        image_seq_length=4,
    )


def tiny_cohere2_vision() -> Any:
    """Cohere 2 Vision: SigLIP on 32x32 tiles, 2x2 downsampling: 4 placeholders per tile."""
    text = {**_TEXT, "model_type": "cohere2", "head_dim": 16, "sliding_window": 8}
    text["layer_types"] = ["sliding_attention", "full_attention"]
    return vlm(
        "Cohere2Vision", text_config=text, vision_config=_SIGLIP, image_token_id=IMG, alignment_intermediate_size=64
    )


def tiny_aya_vision() -> Any:
    """Aya Vision: SigLIP tower on 32x32 tiles, 2x2 downsampling: 4 placeholders per tile; Cohere 2 text (sliding + full)."""
    text = {**_TEXT, "model_type": "cohere2", "head_dim": 16, "sliding_window": 8}
    text["layer_types"] = ["sliding_attention", "full_attention"]
    return vlm("AyaVision", text_config=text, vision_config=_SIGLIP, image_token_index=IMG, downsample_factor=2)


def tiny_aria() -> Any:
    """Aria: Idefics3-style tower on 32x32 crops with a pixel mask, 4 queries per crop; MoE text."""
    vision = {**_CLIP, "model_type": "idefics3_vision"}
    text = {**_TEXT, "model_type": "aria_text", "head_dim": 16}
    text.update(moe_num_experts=2, moe_topk=1, moe_num_shared_experts=1)
    return vlm(
        "Aria", vision_config=vision, text_config=text, image_token_index=IMG, projector_patch_to_query_dict={16: 4}
    )


def tiny_llama4() -> Any:
    """Llama 4: 32x32 tiles, pixel shuffle 0.5: 4 placeholders per tile; chunked (8) + full text layers, MoE."""
    rope = {"rope_type": "default", "rope_theta": 1e4}
    text = {
        **_TEXT,
        "head_dim": 16,
        "intermediate_size_mlp": 128,
        "num_local_experts": 2,
        "interleave_moe_layer_step": 2,
        "attention_chunk_size": 8,
        "no_rope_layer_interval": 2,
        "floor_scale": 4,
        "rope_parameters": rope,
    }
    vision = {
        **_TOWER,
        "intermediate_size": 128,
        "vision_output_dim": 64,
        "image_size": 32,
        "patch_size": 8,
        "projector_input_dim": 64,
        "projector_output_dim": 64,
        "rope_parameters": rope,
    }
    config = transformers.Llama4Config(
        text_config=text, vision_config=vision, image_token_index=IMG, boi_token_index=110, eoi_token_index=111
    )
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    # Not `_build`: its float32 cast would drop the imaginary part of the vision tower's complex rotary buffer.
    return _finalize_in_place(transformers.Llama4ForConditionalGeneration(config).eval())  # type: ignore[no-untyped-call]


def _finalize_in_place(model: Any) -> Any:
    """`tiny_build._finalize` without the dtype cast (the model is built in float32 already)."""
    buffers = {name: b.clone() for name, b in model.named_buffers() if b.is_complex()}
    model = _finalize(model)
    for name, buffer in buffers.items():
        module_name, _, leaf = name.rpartition(".")
        model.get_submodule(module_name)._buffers[leaf] = buffer
    return model
