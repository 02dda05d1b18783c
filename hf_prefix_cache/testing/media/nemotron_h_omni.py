"""A tiny Nemotron-H Omni and its media (images with (h, w) patch grids, audio clips), for its tests and the sweep."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import transformers

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.media.arrays import padded, seeded_rand
from hf_prefix_cache.testing.tiny_vlm_parts import _MEDIA_IDS, _NEMOTRON_H_TEXT, _TOWER, _build

IMG, VID, AUD, OPEN, CLOSE = 120, 121, 126, 110, 111
NEW = 4
SPECIAL_IDS = list(range(100, 128))
#: Patch grids of pool seeds (seeds 1 and 13 alike): 4 patches per placeholder.
GRIDS = [(4, 6), (4, 6), (2, 4)]
#: Valid mel frames of a clip per pool seed, padded to 50: (n + 1) through three stride-2 convolutions.
FRAMES, PADDED, MEL_BINS = [50, 50, 30], 50, 16
AUDIO_COUNTS = {50: 7, 30: 4}
PATCH_DIM = 3 * 4 * 4


@functools.cache
def tiny_nemotron_h_omni() -> Any:
    """Nemotron-H Omni: a RADIO tower on 4x4-pixel patch rows, a 2x2 pixel shuffle; a one-layer Parakeet
    encoder (8x subsampling) on 16 mel bins; Nemotron-H text [Mamba-2, attention, Mamba-2, MLP]."""
    vision = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "patch_size": 4,
        "image_size": 32,
        "max_img_size": 64,
        "num_cls_tokens": 1,
        "num_registers": 1,
        "summary_idxs": [0],
        "patch_dim": PATCH_DIM,
        "video_patch_dim": 2 * PATCH_DIM,
        "video_temporal_patch_size": 2,
    }
    config = transformers.NemotronH_Omni_Reasoning_V3_Config(
        text_config=_NEMOTRON_H_TEXT,
        vision_config=vision,
        audio_config={
            **_TOWER,
            "num_hidden_layers": 1,
            "num_key_value_heads": 4,
            "conv_kernel_size": 3,
            "subsampling_conv_channels": 8,
            "num_mel_bins": MEL_BINS,
            "projection_hidden_size": 64,
            "projection_bias": False,
            "dropout": 0.0,
            "layerdrop": 0.0,
            "activation_dropout": 0.0,
            "attention_dropout": 0.0,
        },
        vision_hidden_size=32,
        projector_hidden_size=64,
        **_MEDIA_IDS,
        audio_token_id=AUD,
    )
    return _build(transformers.NemotronH_Omni_Reasoning_V3, config)


@dataclass(frozen=True)
class Image:
    seed: int
    grid: tuple[int, int]


@dataclass(frozen=True)
class Clip:
    seed: int
    frames: int


def image(seed: int) -> Image:
    return Image(seed, GRIDS[seed % 3])


def clip(seed: int) -> Clip:
    return Clip(seed, FRAMES[seed % 3])


def placeholders(medium: Image | Clip) -> torch.Tensor:
    if isinstance(medium, Clip):
        return torch.tensor([[OPEN, *[AUD] * AUDIO_COUNTS[medium.frames], CLOSE]])
    return torch.tensor([[OPEN, *[IMG] * (medium.grid[0] * medium.grid[1] // 4), CLOSE]])


def media_kwargs(media: list[Any]) -> dict[str, Any]:
    """What the processor hands `generate`: all images' patch rows, one ``(h, w)`` grid each; clips padded to
    50 frames with their masks."""
    out: dict[str, Any] = {}
    images = [m for m in media if isinstance(m, Image)]
    if images:
        rows = [seeded_rand(i.grid[0] * i.grid[1], PATCH_DIM, seed=i.seed) for i in images]
        out.update(pixel_values=torch.cat(rows), image_grid_hw=torch.tensor([list(i.grid) for i in images]))
    clips = [m for m in media if isinstance(m, Clip)]
    if clips:
        features, mask = padded([seeded_rand(c.frames, MEL_BINS, seed=c.seed) for c in clips], PADDED)
        out.update(input_features=features, input_features_mask=mask)
    return out


registry.register_mixed(
    "nemotron_h_omni", tiny_nemotron_h_omni, placeholders, media_kwargs, {"image": image, "audio": clip}, states=True
)
