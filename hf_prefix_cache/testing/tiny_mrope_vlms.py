"""Tiny random-weight M-RoPE vision-language models: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, the GLM-4V family, PaddleOCR-VL.

Built as `tiny_vlm_parts` describes; `tiny_vlms.TINY_VLMS` names them, and `tiny_vlm_media`
builds their media:

* ``qwen2_vl``: M-RoPE text model; an image of grid ``(t, h, w)`` is ``t*h*w`` rows of
  ``3*2*2*2`` values and ``t*h*w/4`` placeholders between vision start/end ids.
* ``glm4v``, ``glm4v_moe``, ``glm46v``, ``glmga``, ``glm_ocr``: Qwen2-VL's patch layout; a video's
  frames are image placeholders between ``VIDEO_START_ID`` and ``VIDEO_END_ID`` (``glm_video_tokens``),
  marked by ``glm_marks``. ``paddleocr_vl``: images only, patches of ``[3, 2, 2]`` (``paddle_pixels``).
"""

from __future__ import annotations

from typing import Any

import transformers

from hf_prefix_cache.testing.tiny_vlm_parts import (
    _MEDIA_IDS,
    _QWEN_IDS,
    _QWEN_TOWER,
    _TEXT,
    _TOWER_8PX,
    IMAGE_ID,
    VIDEO_END_ID,
    VIDEO_ID,
    VIDEO_START_ID,
    VISION_END_ID,
    VISION_START_ID,
    _build,
    text_config,
    vlm,
)

#: The text layers' M-RoPE: sections of 2, 3 and 3 rotary pairs (temporal, height, width).
_MROPE_TEXT = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}


def tiny_qwen2_vl() -> Any:
    """Qwen2-VL (M-RoPE, 2x2 merge)."""
    return vlm(
        "Qwen2VL",
        text_config=text_config("qwen2_vl_text", rope_parameters=_MROPE_TEXT),
        vision_config={
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 4,
            "patch_size": 2,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
            "mlp_ratio": 2,
        },
        **_MEDIA_IDS,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
    )


def tiny_qwen2_5_vl() -> Any:
    """Qwen2.5-VL (M-RoPE, windowed vision attention), same patch layout as Qwen2-VL."""
    return vlm(
        "Qwen2_5_VL",
        text_config=text_config("qwen2_5_vl_text", rope_parameters=_MROPE_TEXT),
        vision_config={"depth": 1, **_QWEN_TOWER, "window_size": 8, "fullatt_block_indexes": [0]},
        **_QWEN_IDS,
    )


def tiny_qwen3_vl() -> Any:
    """Qwen3-VL (interleaved M-RoPE, deepstack features), same patch layout as Qwen2-VL."""
    return vlm(
        "Qwen3VL",
        text_config={
            **_TEXT,
            "model_type": "qwen3_vl_text",
            "head_dim": 16,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e4,
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
        },
        vision_config={"depth": 2, **_QWEN_TOWER, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
        **_QWEN_IDS,
    )


_GLM_VISION: dict[str, Any] = {"depth": 1, **_QWEN_TOWER, "image_size": 8}
_GLM_IDS = {
    "image_token_id": IMAGE_ID,
    "video_token_id": VIDEO_ID,
    "image_start_token_id": VISION_START_ID,
    "image_end_token_id": VISION_END_ID,
    "video_start_token_id": VIDEO_START_ID,
    "video_end_token_id": VIDEO_END_ID,
}


def _glm(config_name: str, model_name: str, text_type: str, vision_type: str, **text: Any) -> Any:
    """A GLM-4V-family model: Qwen2-VL's patch layout (2x2 merge), frames framed by begin/end-of-image ids."""
    config = getattr(transformers, config_name)(
        text_config={**_TEXT, "model_type": text_type, "rope_parameters": _MROPE_TEXT, **text},
        vision_config={**_GLM_VISION, "model_type": vision_type},
        **_GLM_IDS,
    )
    return _build(getattr(transformers, model_name), config)


def tiny_glm4v() -> Any:
    """GLM-4.1V (M-RoPE): images as Qwen2-VL; video frames are image placeholders inside video start/end ids."""
    return _glm("Glm4vConfig", "Glm4vForConditionalGeneration", "glm4v_text", "glm4v_vision")


def tiny_glm4v_moe() -> Any:
    """GLM-4.5V: GLM-4V with a mixture-of-experts text model (half-rotary heads)."""
    rope = {**_MROPE_TEXT, "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 2]}
    experts = {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1}
    text = {"rope_parameters": rope, **experts}
    return _glm("Glm4vMoeConfig", "Glm4vMoeForConditionalGeneration", "glm4v_moe_text", "glm4v_moe_vision", **text)


def tiny_glm46v() -> Any:
    """GLM-4.6V: GLM-4V's text and vision models under its own config and class."""
    return _glm("Glm46VConfig", "Glm46VForConditionalGeneration", "glm4v_text", "glm4v_vision")


def tiny_glmga() -> Any:
    """GLM-GA: its own config type, built as `Glm46VForConditionalGeneration` (as transformers' auto classes do)."""
    return _glm("GlmgaConfig", "Glm46VForConditionalGeneration", "glm4v_text", "glm4v_vision")


def tiny_glm_ocr() -> Any:
    """GLM-OCR: GLM-4V's layout with its own text and vision models."""
    return _glm("GlmOcrConfig", "GlmOcrForConditionalGeneration", "glm_ocr_text", "glm_ocr_vision")


def tiny_paddleocr_vl() -> Any:
    """PaddleOCR-VL (images only): a SigLIP-style tower over ``[3, 2, 2]`` patches, 2x2 merge, M-RoPE text."""
    return vlm(
        "PaddleOCRVL",
        text_config={**_TEXT, "model_type": "paddleocr_vl_text", "head_dim": 16, "rope_parameters": _MROPE_TEXT},
        vision_config={**_TOWER_8PX, "spatial_merge_size": 2},
        **_MEDIA_IDS,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
    )
