"""Tiny HunYuan-VL and its images, as its tests, the family suite and the sweep build them.

Qwen2-VL's flattened patch rows with 2D patches (``h*w`` rows of ``3*2*2`` values per image), a
2x2 merge: an image of grid ``(1, h, w)`` is ``(h/2) * (w/2 + 1) + 2`` placeholders (its row
separators and ends are features too), framed here by ids 122/123. Four rotary axes
(`mrope_section` ``[2, 2, 2, 2]``). Image placeholders 120. Pool seeds 1 and 13 give one
layout, other content.
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

IMAGE, OPEN, CLOSE = 120, 122, 123
GRIDS = [(1, 4, 6), (1, 4, 6), (1, 4, 4)]


def tiny_hunyuan_vl() -> Any:
    """HunYuan-VL: a 2-layer vision tower with its merger, 4-axis M-RoPE text layers."""
    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 2, 2, 2]}
    config = transformers.HunYuanVLConfig(
        text_config={**_TEXT, "head_dim": 16, "rope_parameters": rope},
        vision_config={
            "num_hidden_layers": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "patch_size": 2,
            "spatial_merge_size": 2,
            "out_hidden_size": 64,
            "text_hidden_size": 64,
            "max_image_size": 16,
        },
        image_token_id=IMAGE,
    )
    return _build(transformers.HunYuanVLForConditionalGeneration, config)


@functools.cache
def cached_hunyuan_vl() -> Any:
    """One HunYuan-VL per session."""
    return tiny_hunyuan_vl()


def patches(seed: int, grid: tuple[int, int, int]) -> torch.Tensor:
    """``t*h*w`` flattened patch rows (``3*2*2`` values each) of an image of `grid`."""
    t, h, w = grid
    return torch.rand(t * h * w, 3 * 2 * 2, generator=torch.Generator().manual_seed(seed))


class HunYuanFamily:
    """HunYuan-VL's images, their placeholders and a prompt's media kwargs."""

    name = "hunyuan_vl"

    def __init__(self) -> None:
        self.model = cached_hunyuan_vl()

    def image(self, seed: int) -> Medium:
        return Medium("image", seed, GRIDS[seed % 3])

    def placeholders(self, medium: Medium) -> torch.Tensor:
        _, h, w = medium.grid
        return torch.cat([run(OPEN, 1), run(IMAGE, (h // 2) * (w // 2 + 1) + 2), run(CLOSE, 1)], dim=1)

    def kwargs(self, ids: torch.Tensor, media: list[Medium]) -> dict[str, Any]:
        """What the processor hands `generate` for `ids` holding `media` in prompt order."""
        out: dict[str, Any] = {"mm_token_type_ids": (ids == IMAGE).int()}
        if media:
            out["pixel_values"] = torch.cat([patches(m.seed, m.grid) for m in media])
            out["image_grid_thw"] = torch.tensor([list(m.grid) for m in media])
        return out


def _sweep() -> registry.SweepCase:
    """A an image; C two images with text between them."""
    fam = HunYuanFamily()
    media = registry.mixed(fam.image, fam.image, fam.image)
    return registry.mixed_sweep(fam.model, fam.placeholders, media, fam.kwargs, first=1)


def _suite() -> MediaCase:
    fam = HunYuanFamily()
    return MediaCase(fam.name, fam.model, {"image": fam.image}, fam.placeholders, fam.kwargs, longer=True, repeat=True)


registry.register_sweep(HunYuanFamily.name, _sweep)
registry.register_suite(HunYuanFamily.name, _suite)
