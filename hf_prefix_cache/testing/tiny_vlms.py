"""Tiny random-weight vision-language models, built offline from config classes, and a registry of them.

Built as `tiny_vlm_parts` describes; their media and prompt pieces are in `tiny_vlm_media`, their
processors in `tiny_processors`, and the M-RoPE families (Qwen2-VL on, GLM-4V, PaddleOCR-VL) in
`tiny_mrope_vlms`:

* ``llava``: CLIP vision tower (32x32 images, 8x8 patches): 16 placeholders per image.
* ``llava_next``: the same tower with anyres tiling (pinpoints up to 64x64); an image's
  placeholder count depends on its size (``llava_next_tokens``). Pixels come from the real
  ``LlavaNextImageProcessorPil``, which pads every prompt's patch stacks to its largest image.
"""

from __future__ import annotations

from typing import Any

import transformers

from hf_prefix_cache.testing.tiny_build import ModelTable
from hf_prefix_cache.testing.tiny_mrope_vlms import (
    tiny_glm4v,
    tiny_glm4v_moe,
    tiny_glm46v,
    tiny_glm_ocr,
    tiny_glmga,
    tiny_paddleocr_vl,
    tiny_qwen2_5_vl,
    tiny_qwen2_vl,
    tiny_qwen3_vl,
)
from hf_prefix_cache.testing.tiny_vlm_parts import (
    _CLIP,
    _MEDIA_INDEX,
    _SIGLIP,
    _TEXT,
    _WHISPER,
    AUDIO_ID,
    BOI_ID,
    EOI_ID,
    IMAGE_ID,
    MEL_FRAMES,
    PINPOINTS,
    _build,
    text_config,
    vlm,
)


def tiny_llava() -> Any:
    """LLaVA with a Llama text model: 16 placeholders per 32x32 image."""
    return vlm(
        "Llava",
        text_config=text_config("llama"),
        vision_config=_CLIP,
        image_token_index=IMAGE_ID,
        vision_feature_layer=-1,
    )


def tiny_llava_next() -> Any:
    """LLaVA-NeXT (anyres) with a Llama text model."""
    return vlm(
        "LlavaNext",
        text_config=text_config("llama"),
        vision_config=_CLIP,
        image_token_index=IMAGE_ID,
        vision_feature_layer=-1,
        image_grid_pinpoints=PINPOINTS,
    )


def tiny_llava_next_video() -> Any:
    """LLaVA-NeXT-Video: LLaVA-NeXT images; each 32x32 video frame is 4 placeholders (2x2 pooling)."""
    return vlm(
        "LlavaNextVideo",
        text_config=text_config("llama"),
        vision_config=_CLIP,
        **_MEDIA_INDEX,
        vision_feature_layer=-1,
        image_grid_pinpoints=PINPOINTS,
        spatial_pool_stride=2,
    )


def tiny_llava_onevision() -> Any:
    """LLaVA-OneVision (anyres, SigLIP tower, Qwen2 text), the config's default `vision_aspect_ratio`."""
    return vlm(
        "LlavaOnevision",
        text_config=text_config("qwen2"),
        vision_config={**_CLIP, "model_type": "siglip_vision_model"},
        **_MEDIA_INDEX,
        vision_feature_layer=-1,
        image_grid_pinpoints=PINPOINTS,
    )


def tiny_gemma3(config_cls: Any = transformers.Gemma3Config) -> Any:
    """Gemma 3: 4 placeholders per image between begin/end-of-image ids; sliding + full text layers.

    `config_cls` ShieldGemma2Config builds ShieldGemma 2's generator (the same class, its own model type).
    """
    config = config_cls(
        text_config={
            **_TEXT,
            "model_type": "gemma3_text",
            "head_dim": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        vision_config=_SIGLIP,
        mm_tokens_per_image=4,
        image_token_index=IMAGE_ID,
        boi_token_index=BOI_ID,
        eoi_token_index=EOI_ID,
    )
    return _build(transformers.Gemma3ForConditionalGeneration, config)


def tiny_paligemma() -> Any:
    """PaliGemma (prefix-LM): 16 placeholders per image at the start of the prompt."""
    return vlm(
        "PaliGemma",
        text_config=text_config("gemma", head_dim=16),
        vision_config={**_SIGLIP, "projection_dim": 64},
        image_token_index=IMAGE_ID,
        projection_dim=64,
    )


def tiny_qwen2_audio() -> Any:
    """Qwen2-Audio: clips of 100 mel frames (16 bins); a clip of `f` valid frames has `((f-1)//2+1-2)//2+1` placeholders."""
    return vlm(
        "Qwen2Audio",
        text_config=text_config("qwen2"),
        audio_config={"model_type": "qwen2_audio_encoder", **_WHISPER, "max_source_positions": MEL_FRAMES // 2},
        audio_token_index=AUDIO_ID,
    )


def _idefics3_config(config_cls: type, vision_type: str) -> Any:
    return config_cls(
        text_config=text_config("llama"),
        vision_config={**_CLIP, "model_type": vision_type},
        scale_factor=2,
        image_token_id=IMAGE_ID,
    )


def tiny_idefics3() -> Any:
    """Idefics3: each 32x32 crop is 4 placeholders (pixel shuffle 2), framed by fake-image ids."""
    return _build(
        transformers.Idefics3ForConditionalGeneration, _idefics3_config(transformers.Idefics3Config, "idefics3_vision")
    )


def tiny_smolvlm() -> Any:
    """SmolVLM: Idefics3's layout."""
    return _build(
        transformers.SmolVLMForConditionalGeneration, _idefics3_config(transformers.SmolVLMConfig, "smolvlm_vision")
    )


#: Idefics2's perceiver resampler: 4 latents per crop.
_IDEFICS2_PERCEIVER: dict[str, Any] = {
    "hidden_size": 64,
    "resampler_n_latents": 4,
    "resampler_depth": 1,
    "resampler_n_heads": 4,
    "resampler_head_dim": 16,
    "num_key_value_heads": 2,
}


def tiny_idefics2() -> Any:
    """Idefics2: each 32x32 crop is 4 placeholders (a perceiver resampler of 4 latents), framed by fake-image ids."""
    return vlm(
        "Idefics2",
        text_config=text_config("mistral"),
        vision_config={**_CLIP, "model_type": "idefics2_vision"},
        perceiver_config=_IDEFICS2_PERCEIVER,
        image_token_id=IMAGE_ID,
    )


TINY_VLMS = ModelTable(
    {
        "idefics2": tiny_idefics2,
        "llava_next_video": tiny_llava_next_video,
        "idefics3": tiny_idefics3,
        "smolvlm": tiny_smolvlm,
        "qwen3_vl": tiny_qwen3_vl,
        "glm4v": tiny_glm4v,
        "glm4v_moe": tiny_glm4v_moe,
        "glm46v": tiny_glm46v,
        "glmga": tiny_glmga,
        "glm_ocr": tiny_glm_ocr,
        "paddleocr_vl": tiny_paddleocr_vl,
        "qwen2_audio": tiny_qwen2_audio,
        "gemma3": tiny_gemma3,
        "shieldgemma2": lambda: tiny_gemma3(transformers.ShieldGemma2Config),
        "paligemma": tiny_paligemma,
        "llava": tiny_llava,
        "llava_next": tiny_llava_next,
        "qwen2_vl": tiny_qwen2_vl,
        "llava_onevision": tiny_llava_onevision,
        "qwen2_5_vl": tiny_qwen2_5_vl,
    }
)


#: One model per family per session.
cached_vlm = TINY_VLMS.one
