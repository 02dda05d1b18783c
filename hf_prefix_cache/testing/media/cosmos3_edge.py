"""Tiny Cosmos 3 Edge and its media, as the family suite and the sweep build them.

A SigLIP 2-style tower on 2D patch rows (``t*h*w`` rows of ``3*2*2`` values), a 2x2 merge:
an image is ``h*w/4`` placeholders between vision start and end; a video is written as Qwen3-VL's
(per frame its timestamp text, vision start, ``h*w/4`` placeholders, vision end). Ids as
`tiny_qwen_media`: images 120, videos 121, vision start/end 122/123. Pool seeds 1 and 13 give one
layout, other content.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import transformers

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.media.cases import MediaCase
from hf_prefix_cache.testing.media.ernie4_5_vl import patches
from hf_prefix_cache.testing.media.grid import Medium
from hf_prefix_cache.testing.tiny_qwen_media import image_tokens, qwen3_video_tokens
from hf_prefix_cache.testing.tiny_vlm_parts import _QWEN_IDS, _TEXT, IMAGE_ID, VIDEO_ID, _build

GRIDS = [(1, 4, 6), (1, 4, 6), (1, 4, 4)]
VIDEO_GRIDS = [(2, 2, 4), (2, 2, 4), (3, 2, 2)]


def tiny_cosmos3_edge() -> Any:
    """Cosmos 3 Edge: a 2-layer SigLIP 2-style tower, its projector, M-RoPE text layers."""
    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}
    config = transformers.Cosmos3EdgeConfig(
        text_config={**_TEXT, "head_dim": 16, "rope_parameters": rope},
        vision_config={
            "num_hidden_layers": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 4,
            "patch_size": 2,
            "num_patches": 16,
            "spatial_merge_size": 2,
        },
        projector_hidden_size=64,
        **_QWEN_IDS,
    )
    return _build(transformers.Cosmos3EdgeForConditionalGeneration, config)


@functools.cache
def cached_cosmos3_edge() -> Any:
    """One Cosmos 3 Edge per session."""
    return tiny_cosmos3_edge()


class Cosmos3EdgeFamily:
    """Cosmos 3 Edge's media, their placeholders and a prompt's media kwargs."""

    name = "cosmos3_edge"

    def __init__(self) -> None:
        self.model = cached_cosmos3_edge()

    def image(self, seed: int) -> Medium:
        return Medium("image", seed, GRIDS[seed % 3])

    def video(self, seed: int) -> Medium:
        return Medium("video", seed, VIDEO_GRIDS[seed % 3])

    def placeholders(self, medium: Medium) -> torch.Tensor:
        return image_tokens(medium.grid) if medium.kind == "image" else qwen3_video_tokens(medium.grid)

    def first(self, medium: Medium) -> int:
        """Offset of the medium's first placeholder in its tokens."""
        return int((self.placeholders(medium)[0] == (IMAGE_ID if medium.kind == "image" else VIDEO_ID)).nonzero()[0])

    def kwargs(self, ids: torch.Tensor, media: list[Medium]) -> dict[str, Any]:
        """What the processor hands `generate` for `ids` holding `media` in prompt order."""
        out: dict[str, Any] = {"mm_token_type_ids": (ids == IMAGE_ID).int() + 2 * (ids == VIDEO_ID).int()}
        for kind, pixels, grid in (
            ("image", "pixel_values", "image_grid_thw"),
            ("video", "pixel_values_videos", "video_grid_thw"),
        ):
            mine = [m for m in media if m.kind == kind]
            if mine:
                out[pixels] = torch.cat([patches(m.seed, m.grid) for m in mine])
                out[grid] = torch.tensor([list(m.grid) for m in mine])
        return out


def _sweep() -> registry.SweepCase:
    """A an image; C an image, text, then a video."""
    fam = Cosmos3EdgeFamily()
    media = registry.mixed(fam.image, fam.image, fam.video)
    return registry.mixed_sweep(fam.model, fam.placeholders, media, fam.kwargs, first=fam.first(media["a"][0]))


def _suite() -> MediaCase:
    fam = Cosmos3EdgeFamily()
    media = {"image": fam.image, "video": fam.video}
    return MediaCase(
        fam.name, fam.model, media, fam.placeholders, fam.kwargs, framing=fam.first, longer=True, repeat=True
    )


registry.register_sweep(Cosmos3EdgeFamily.name, _sweep)
registry.register_suite(Cosmos3EdgeFamily.name, _suite)
