"""A tiny Phi-4-multimodal and its media, as the Phi-4 media tests and the sweep build them.

Images are HD crop stacks: a ``h x w`` image (multiples of the 32-pixel crop) is its global crop
and ``(h / 32) * (w / 32)`` sub-crops, padded per prompt to the most crops with a patch mask, as
the processor pads them; its placeholder count follows from its crops. Audio clips are mel rows
(16 bins) padded to 64 frames with a mask; 8 frames per placeholder. Ids: image 120, audio 126.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import transformers

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.tiny_vlm_parts import _TEXT, _TOWER, _build

IMG, AUD = 120, 126
CROP, MEL, CLIP_FRAMES, BASE = 32, 16, 64, 2


def tiny_phi4_multimodal() -> Any:
    """Phi-4-multimodal: SigLIP-style crops of 32x32 pixels (2x2 features each after pooling), a conformer on audio."""
    vision = {
        **_TOWER,
        "image_size": CROP,
        "patch_size": 8,
        "crop_size": CROP,
        "image_token_id": IMG,
        "feature_layer": -2,
    }
    audio = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_blocks": 2,
        "num_attention_heads": 4,
        "ext_pw_out_channel": 32,
        "depthwise_separable_out_channel": 32,
        "input_size": MEL,
        "time_reduction": 8,
        "nemo_conv_channels": 32,
        "audio_token_id": AUD,
        "left_chunk": 2,
    }
    config = transformers.Phi4MultimodalConfig(**_TEXT, vision_config=vision, audio_config=audio)
    return _build(transformers.Phi4MultimodalForCausalLM, config)


@functools.cache
def cached_phi4() -> Any:
    return tiny_phi4_multimodal()


def _rand(seed: int, *shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed))


@dataclass(frozen=True)
class Medium:
    """An image (its crops and ``(h, w)``) or a clip (its padded mel rows, mask and placeholder count)."""

    kind: str
    data: torch.Tensor
    size: torch.Tensor
    count: int


def image(seed: int) -> Medium:
    """Seeds 1 and 13 (and 25): a 32x32 image; others 32x64 (two sub-crops)."""
    height, width = [(32, 64), (32, 32), (32, 64)][seed % 3]
    crops = 1 + (height // CROP) * (width // CROP)
    ratio_h, ratio_w = height // CROP, width // CROP
    count = ratio_h * BASE * (ratio_w * BASE + 1) + 1 + BASE * (BASE + 1)  # sub-crops, separator, global crop
    return Medium("image", _rand(seed, crops, 3, CROP, CROP), torch.tensor([height, width]), count)


def clip(seed: int) -> Medium:
    """Seeds 1 and 13 (and 25): 40 valid frames (5 placeholders); others 64 (8)."""
    frames = [64, 40, 64][seed % 3]
    features = torch.zeros(CLIP_FRAMES, MEL)
    features[:frames] = _rand(seed, frames, MEL)
    return Medium("audio", features, torch.tensor(frames), (frames + 7) // 8)


def placeholders(medium: Medium) -> torch.Tensor:
    return torch.full((1, medium.count), IMG if medium.kind == "image" else AUD)


def kwargs(media: list[Medium]) -> dict[str, Any]:
    """What the processor hands `generate` for `media` in prompt order."""
    out: dict[str, Any] = {}
    images = [m for m in media if m.kind == "image"]
    if images:
        most = max(m.data.shape[0] for m in images)
        pixels = torch.zeros(len(images), most, 3, CROP, CROP)
        mask = torch.zeros(len(images), most, 2 * BASE, 2 * BASE, dtype=torch.bool)
        for i, m in enumerate(images):
            pixels[i, : m.data.shape[0]] = m.data
            mask[i, : m.data.shape[0]] = True
        sizes = torch.stack([m.size for m in images])
        out.update(image_pixel_values=pixels, image_sizes=sizes, image_attention_mask=mask)
    clips = [m for m in media if m.kind == "audio"]
    if clips:
        masks = torch.stack([torch.arange(CLIP_FRAMES) < m.size for m in clips])
        out.update(
            audio_input_features=torch.stack([m.data for m in clips]),
            audio_embed_sizes=torch.tensor([m.count for m in clips]),
            audio_attention_mask=masks,
        )
    return out


def _sweep() -> registry.SweepCase:
    """Phi-4-multimodal in the support matrix's scenario: A an image; C an audio clip, text, then an image."""
    media = registry.mixed(image, clip, image)
    return registry.mixed_sweep(cached_phi4(), placeholders, media, lambda _ids, held: kwargs(held), first=0)


registry.register_sweep("phi4_multimodal", _sweep)
