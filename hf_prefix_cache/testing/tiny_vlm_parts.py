"""What the tiny VLMs share: their placeholder ids, text and tower configs, and the build step.

Placeholders use ids above 100 (text ids come from ``random_prompt``, ``[4, 100)``). Each
builder seeds ``torch.manual_seed(0)`` and returns an eval-mode float32 model with eager
attention whose generation never stops early (`_build`, through ``tiny_build._finalize``).
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

from hf_prefix_cache.testing.tiny_build import _finalize

IMAGE_ID, VIDEO_ID, VISION_START_ID, VISION_END_ID = 120, 121, 122, 123
AUDIO_ID = 126
BOI_ID, EOI_ID = 124, 125
FAKE_IMAGE_ID = 124
#: GLM-4V's video start/end ids: a video's frames are image placeholders between them.
VIDEO_START_ID, VIDEO_END_ID = 110, 111
PINPOINTS = [[32, 32], [32, 64], [64, 32], [64, 64]]
MEL_BINS, MEL_FRAMES = 16, 100

_TEXT: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": None,
}
#: The tiny towers' shape (vision or audio): 2 layers of width 32, 4 heads, MLP 64; each family adds its own keys.
_TOWER: dict[str, Any] = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
#: The same shape under the key names of Qwen2-VL-style towers (`depth`, `num_heads`).
_DEPTH_TOWER: dict[str, Any] = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4}
_CLIP: dict[str, Any] = {
    "model_type": "clip_vision_model",
    **_TOWER,
    "image_size": 32,
    "patch_size": 8,
}
_SIGLIP = {**_CLIP, "model_type": "siglip_vision_model"}

#: The Qwen2.5-VL / Qwen3-VL-style vision tower's shape; each family adds its depth and its own keys.
_QWEN_TOWER: dict[str, Any] = {
    "hidden_size": 32,
    "out_hidden_size": 64,
    "intermediate_size": 64,
    "num_heads": 4,
    "patch_size": 2,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
#: The placeholder and framing ids of the Qwen-VL families.
_QWEN_IDS: dict[str, Any] = {
    "image_token_id": IMAGE_ID,
    "video_token_id": VIDEO_ID,
    "vision_start_token_id": VISION_START_ID,
    "vision_end_token_id": VISION_END_ID,
}


def _build(model_cls: type, config: Any) -> Any:
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    return _finalize(model_cls(config))


def text_config(model_type: str, **extra: Any) -> dict[str, Any]:
    """The tiny text layers (`_TEXT`) as the config of `model_type`, with `extra` keys on top.

    Example:
        >>> text_config("qwen3", head_dim=16)["head_dim"]
        16
    """
    return {**_TEXT, "model_type": model_type, **extra}


def vlm(name: str, **config: Any) -> Any:
    """transformers' ``{name}ForConditionalGeneration``, built as `_build` does from ``{name}Config(**config)``.

    Example:
        >>> model = vlm("Llava", text_config=text_config("llama"), vision_config=_CLIP, image_token_index=IMAGE_ID)
        >>> type(model).__name__
        'LlavaForConditionalGeneration'
    """
    config_cls = getattr(transformers, f"{name}Config")
    return _build(getattr(transformers, f"{name}ForConditionalGeneration"), config_cls(**config))
