"""Tiny models of the generic families whose images are one placeholder run each (or one per patch).

Pixtral-tower families (images padded per prompt, `image_sizes` their valid size; the real
`PixtralProcessor` too), LLaVA-like ones with a fixed count per image (SigLIP, CLIP and
SAM-style towers), Video-LLaVA, Fuyu's per-patch items and LFM2-VL's NaFlex rows. Each is
built from its config classes (float32, eager, seed 0); `generic_models` names them.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any, Literal

import transformers

from hf_prefix_cache.testing.media.generic_ids import IMG
from hf_prefix_cache.testing.tiny_build import _INDEXER, _MLA, _ROUTED_EXPERTS
from hf_prefix_cache.testing.tiny_processors import tiny_tokenizer
from hf_prefix_cache.testing.tiny_vlm_parts import (
    _CLIP,
    _MEDIA_INDEX,
    _SAM,
    _SIGLIP,
    _TEXT,
    _TOWER,
    _build,
    text_config,
    vlm,
)

_PIXTRAL = {
    "model_type": "pixtral",
    **_TOWER,
    "head_dim": 8,
    "image_size": 64,
    "patch_size": 8,
}


def tiny_mistral3() -> Any:
    """Mistral 3: Pixtral tower, 2x2 patch merger: one placeholder per 16x16 pixels."""
    return vlm(
        "Mistral3",
        text_config=text_config("mistral", head_dim=16),
        vision_config=_PIXTRAL,
        image_token_index=IMG,
        spatial_merge_size=2,
    )


def tiny_llava_pixtral(strategy: Literal["default", "full"] = "full") -> Any:
    """LLaVA with a Pixtral tower: one placeholder per 8x8 patch."""
    return vlm(
        "Llava",
        text_config=text_config("mistral", head_dim=16),
        vision_config=_PIXTRAL,
        image_token_index=IMG,
        vision_feature_layer=-1,
        vision_feature_select_strategy=strategy,
    )


def tiny_lighton_ocr() -> Any:
    """LightOnOCR: Mistral 3's Pixtral tower and 2x2 patch merger, Qwen 3 text."""
    return vlm("LightOnOcr", text_config=text_config("qwen3", head_dim=16), vision_config=_PIXTRAL, image_token_id=IMG)


def tiny_mistral_large4() -> Any:
    """Mistral Large 4: Mistral 3's Pixtral tower and 2x2 patch merger; MLA text with an indexer (sparse attention) and experts."""
    text = {
        **_TEXT,
        "model_type": "mistral_large4_text",
        **_MLA,
        **_ROUTED_EXPERTS,
        **_INDEXER,
        # every key of the media prompts: past it a store runs cold (`indexer_top_k`)
    }
    return vlm("MistralLarge4", text_config=text, vision_config=_PIXTRAL, image_token_index=IMG, spatial_merge_size=2)


@functools.cache
def pixtral_processor(spatial_merge_size: int) -> Any:
    """The real `PixtralProcessor` (PIL image processor, images up to 64x64) with the tiny tokenizer: [IMG] is 120.

    Its module imports one size helper from the torchvision image processor (torchvision is not
    installed here); the PIL module's identical helper stands in for it.
    """
    from transformers.models.pixtral import image_processing_pil_pixtral

    shim = types.ModuleType("transformers.models.pixtral.image_processing_pixtral")
    shim.get_resize_output_image_size = image_processing_pil_pixtral.get_resize_output_image_size  # type: ignore[attr-defined]
    sys.modules.setdefault(shim.__name__, shim)
    from transformers.models.pixtral.processing_pixtral import PixtralProcessor

    image_processor = transformers.PixtralImageProcessorPil(patch_size=8, size={"longest_edge": 64})
    return PixtralProcessor(
        image_processor=image_processor,
        tokenizer=tiny_tokenizer(["[IMG]", "[IMG_BREAK]", "[IMG_END]"]),
        patch_size=8,
        spatial_merge_size=spatial_merge_size,
    )


def tiny_video_llava() -> Any:
    """Video-LLaVA: CLIP towers; 16 placeholders per image (CLS dropped), 17 per video frame."""
    return vlm(
        "VideoLlava", text_config=text_config("llama"), vision_config=_CLIP, **_MEDIA_INDEX, vision_feature_layer=-1
    )


def tiny_vipllava() -> Any:
    """VipLLaVA (LLaVA with multi-layer vision features): 16 placeholders per 32x32 image (CLS dropped)."""
    config = transformers.VipLlavaConfig(  # type: ignore[call-arg]
        text_config=text_config("llama"),
        vision_config=_CLIP,
        image_token_index=IMG,
        vision_feature_layers=[-2, -1],
    )
    return _build(transformers.VipLlavaForConditionalGeneration, config)


def tiny_deepseek_vl() -> Any:
    """DeepSeek-VL: SigLIP tower, 16 placeholders per 32x32 image."""
    return vlm("DeepseekVL", text_config=text_config("llama"), vision_config=_SIGLIP, image_token_id=IMG)


#: Janus's SigLIP-style tower on 32x32 images (16 placeholders each).
_JANUS_VISION: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": 32,
    "patch_size": 8,
    "projection_dim": 64,
    "num_image_tokens": 16,
    "mlp_ratio": 2,
}

#: Janus's VQ-VAE (its image-generation head).
_JANUS_VQ: dict[str, Any] = {
    "embed_dim": 8,
    "num_embeddings": 32,
    "latent_channels": 32,
    "base_channels": 32,
    "channel_multiplier": [1, 1],
    "num_res_blocks": 1,
    "num_patches": 4,
    "projection_dim": 64,
    "image_token_embed_dim": 64,
}


def tiny_janus() -> Any:
    """Janus: SigLIP-style tower on 32x32 images, 16 placeholders each; a tiny VQ-VAE for its image-generation head."""
    return vlm(
        "Janus", text_config=text_config("llama"), vision_config=_JANUS_VISION, vq_config=_JANUS_VQ, image_token_id=IMG
    )


def tiny_got_ocr2(config_cls: Any = transformers.GotOcr2Config) -> Any:
    """GOT-OCR 2: a SAM-style tower on 64x64 images: 4 placeholders each.

    `config_cls` PPChart2TableConfig builds PP-Chart2Table (GOT-OCR 2's class, its own model type).
    """
    config = config_cls(text_config=text_config("qwen2"), vision_config=_SAM, image_token_index=IMG)
    return _build(transformers.GotOcr2ForConditionalGeneration, config)


def tiny_deepseek_vl_hybrid() -> Any:
    """DeepSeek-VL hybrid: a SigLIP tower on 32x32 images and a SAM-style tower on their 64x64 versions, 16
    placeholders per image."""
    return vlm(
        "DeepseekVLHybrid",
        text_config=text_config("llama"),
        vision_config=_SIGLIP,
        high_res_vision_config=_SAM,
        image_token_id=IMG,
    )


def tiny_fuyu() -> Any:
    """Fuyu: 4x4-pixel patches (48 values) embedded one by one; Persimmon text."""
    config = transformers.FuyuConfig(
        text_config=text_config("persimmon"),
        patch_size=4,
        num_channels=3,
        image_token_id=IMG,
    )
    config.hidden_size, config.vocab_size = 64, 128  # read by its forward; not in the config's signature
    return _build(transformers.FuyuForCausalLM, config)


#: LFM2-VL rows: patches of 4x4 pixels (3 channels), padded to 24 patches per row.
LFM2_PATCH, LFM2_ROW_LEN = 4, 24


def tiny_lfm2_vl() -> Any:
    """LFM2-VL: SigLIP 2 NaFlex tower (4x4-pixel patches), 2x2 patches per placeholder; LFM2 text [conv, attn] x 2."""
    text = {**_TEXT, "model_type": "lfm2", "num_hidden_layers": 4, "conv_L_cache": 3, "block_auto_adjust_ff_dim": False}
    text["layer_types"] = ["conv", "full_attention", "conv", "full_attention"]
    vision = {
        "model_type": "siglip2_vision_model",
        **_TOWER,
        "patch_size": LFM2_PATCH,
        "num_patches": 16,
        "vision_use_head": False,
    }
    return vlm(
        "Lfm2Vl",
        text_config=text,
        vision_config=vision,
        image_token_id=IMG,
        downsample_factor=2,
        projector_hidden_size=64,
    )
