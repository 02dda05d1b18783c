"""What the tiny VLMs share: their placeholder ids, text and tower configs, and the build step.

Placeholders use ids above 100 (text ids come from ``random_prompt``, ``[4, 100)``). Each
builder seeds ``torch.manual_seed(0)`` and returns an eval-mode float32 model with eager
attention whose generation never stops early (`_build`, through ``tiny_build._finalize``).
"""

from __future__ import annotations

import copy
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
#: A one-layer tower on 8x8 images of 2x2 patches.
_TOWER_8PX: dict[str, Any] = {**_TOWER, "num_hidden_layers": 1, "image_size": 8, "patch_size": 2}
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
#: A SAM-style tower (windowed and global attention) on 64x64 images.
_SAM: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "output_channels": 16,
    "image_size": 64,
    "patch_size": 8,
    "window_size": 4,
    "global_attn_indexes": [1],
    "mlp_dim": 64,
}
#: A Whisper-style audio encoder on `MEL_BINS` mel bins: 2 layers of width 32, 4 heads, MLP 64.
_WHISPER: dict[str, Any] = {
    "d_model": 32,
    "encoder_layers": 2,
    "encoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "num_mel_bins": MEL_BINS,
}
#: Nemotron-H text layers [Mamba-2, attention, Mamba-2, MLP] (the layer count is their pattern's length).
_NEMOTRON_H_TEXT: dict[str, Any] = {
    **{k: v for k, v in _TEXT.items() if k != "num_hidden_layers"},
    "model_type": "nemotron_h",
    "head_dim": 16,
    "layers_block_type": ["linear_attention", "full_attention", "linear_attention", "mlp"],
    "ssm_state_size": 16,
    "mamba_num_heads": 4,
    "mamba_head_dim": 16,
    "n_groups": 2,
    "conv_kernel": 4,
    "expand": 1,
    "chunk_size": 8,
    "mlp_hidden_act": "relu2",
}
#: The placeholder and framing ids of the families that frame images and videos with their own start / end ids.
_FRAMED_IDS: dict[str, Any] = {
    "image_token_id": IMAGE_ID,
    "video_token_id": VIDEO_ID,
    "image_start_token_id": 122,
    "image_end_token_id": 123,
    "video_start_token_id": 124,
    "video_end_token_id": 125,
}
#: The image and video placeholder ids under the config keys most families use, and under the LLaVA-style keys.
_MEDIA_IDS: dict[str, Any] = {"image_token_id": IMAGE_ID, "video_token_id": VIDEO_ID}
_MEDIA_INDEX: dict[str, Any] = {"image_token_index": IMAGE_ID, "video_token_index": VIDEO_ID}
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

    The config gets a deep copy of `config`: the shared parts (`_TOWER`, `_SAM`, ...) stay as written
    whatever a config class does to the dicts it is given.

    Example:
        >>> model = vlm("Llava", text_config=text_config("llama"), vision_config=_CLIP, image_token_index=IMAGE_ID)
        >>> type(model).__name__
        'LlavaForConditionalGeneration'
    """
    config_cls = getattr(transformers, f"{name}Config")
    return _build(getattr(transformers, f"{name}ForConditionalGeneration"), config_cls(**copy.deepcopy(config)))
