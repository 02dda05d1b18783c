"""Tiny Ernie 4.5 VL (MoE) and its media, as its tests, the family suite and the sweep build them.

Qwen2-VL's patch layout with 2D patches (``t*h*w`` rows of ``3*2*2`` values), a 2x2 spatial
merge and a 2-frame temporal merge: an image is ``h*w/4`` placeholders between image start and
end ids, a video ``t*h*w/8`` between video start and end ids. Its text layers: a dense one, then
one of text and vision experts, chosen per token by the processor's `moe_mm_token_type_ids`.
Ids: images 120, videos 121, image start/end 122/123, video start/end 124/125. Pool seeds 1
and 13 give one layout, other content.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import transformers

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.media.cases import MediaCase
from hf_prefix_cache.testing.media.grid import Medium
from hf_prefix_cache.testing.tiny_vlm_media import run
from hf_prefix_cache.testing.tiny_vlm_parts import _TEXT, _build

IMAGE, VIDEO, IMAGE_START, IMAGE_END, VIDEO_START, VIDEO_END = 120, 121, 122, 123, 124, 125
GRIDS = [(1, 4, 6), (1, 4, 6), (1, 2, 4)]
VIDEO_GRIDS = [(2, 4, 4), (2, 4, 4), (4, 2, 2)]


def tiny_ernie4_5_vl() -> Any:
    """Ernie 4.5 VL: a 2-layer vision tower, the resampler, and [dense, text + vision experts] text layers."""
    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [3, 3, 2]}
    experts = {"moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": [32, 16], "moe_num_shared_experts": 1}
    config = transformers.Ernie4_5_VLMoeConfig(
        text_config={
            **_TEXT,
            "head_dim": 16,
            "rope_parameters": rope,
            **experts,
            "mlp_layer_types": ["dense", "sparse"],
        },
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 4,
            "patch_size": 2,
            "spatial_merge_size": 2,
            "temporal_merge_size": 2,
        },
        image_token_id=IMAGE,
        video_token_id=VIDEO,
        image_start_token_id=IMAGE_START,
        image_end_token_id=IMAGE_END,
        video_start_token_id=VIDEO_START,
        video_end_token_id=VIDEO_END,
    )
    return _build(transformers.Ernie4_5_VLMoeForConditionalGeneration, config)


@functools.cache
def cached_ernie4_5_vl() -> Any:
    """One Ernie 4.5 VL per session."""
    return tiny_ernie4_5_vl()


def patches(seed: int, grid: tuple[int, int, int]) -> torch.Tensor:
    """``t*h*w`` flattened patch rows (``3*2*2`` values each) of an image or video of `grid`."""
    t, h, w = grid
    return torch.rand(t * h * w, 3 * 2 * 2, generator=torch.Generator().manual_seed(seed))


def expert_marks(ids: torch.Tensor) -> torch.Tensor:
    """The processor's `moe_mm_token_type_ids`: placeholders and their start/end ids, 1 for images, 2 for videos."""
    marks = torch.zeros_like(ids, dtype=torch.int)
    for token_ids, code in (((IMAGE, IMAGE_START, IMAGE_END), 1), ((VIDEO, VIDEO_START, VIDEO_END), 2)):
        for token_id in token_ids:
            marks[ids == token_id] = code
    return marks


class ErnieFamily:
    """Ernie 4.5 VL's media, their placeholders and a prompt's media kwargs."""

    name = "ernie4_5_vl_moe"

    def __init__(self) -> None:
        self.model = cached_ernie4_5_vl()

    def image(self, seed: int) -> Medium:
        return Medium("image", seed, GRIDS[seed % 3])

    def video(self, seed: int) -> Medium:
        return Medium("video", seed, VIDEO_GRIDS[seed % 3])

    def placeholders(self, medium: Medium) -> torch.Tensor:
        t, h, w = medium.grid
        if medium.kind == "image":
            return torch.cat([run(IMAGE_START, 1), run(IMAGE, t * h * w // 4), run(IMAGE_END, 1)], dim=1)
        return torch.cat([run(VIDEO_START, 1), run(VIDEO, t * h * w // 8), run(VIDEO_END, 1)], dim=1)

    def kwargs(self, ids: torch.Tensor, media: list[Medium]) -> dict[str, Any]:
        """What the processor hands `generate` for `ids` holding `media` in prompt order."""
        out: dict[str, Any] = {
            "mm_token_type_ids": (ids == IMAGE).int() + 2 * (ids == VIDEO).int(),
            "moe_mm_token_type_ids": expert_marks(ids),
        }
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
    fam = ErnieFamily()
    media = registry.mixed(fam.image, fam.image, fam.video)
    return registry.mixed_sweep(fam.model, fam.placeholders, media, fam.kwargs, first=1)


def _suite() -> MediaCase:
    fam = ErnieFamily()
    media = {"image": fam.image, "video": fam.video}
    return MediaCase(fam.name, fam.model, media, fam.placeholders, fam.kwargs, longer=True, repeat=True)


registry.register_sweep(ErnieFamily.name, _sweep)
registry.register_suite(ErnieFamily.name, _suite)
