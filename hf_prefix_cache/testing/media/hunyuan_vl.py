"""Tiny HunYuan-VL and its images, as its tests, the family suite and the sweep build them.

Qwen2-VL's flattened patch rows with 2D patches (``h*w`` rows of ``3*2*2`` values per image), a
2x2 merge: an image of grid ``(1, h, w)`` is ``(h/2) * (w/2 + 1) + 2`` placeholders (its row
separators and ends are features too), framed here by ids 122/123. Four rotary axes
(`mrope_section` ``[2, 2, 2, 2]``). Image placeholders 120. Pool seeds 1 and 13 give one
layout, other content.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.media.thw import Medium, ThwFamily
from hf_prefix_cache.testing.tiny_vlm_media import run
from hf_prefix_cache.testing.tiny_vlm_parts import _TEXT, _TOWER, IMAGE_ID, VISION_END_ID, VISION_START_ID, vlm

IMAGE, OPEN, CLOSE = IMAGE_ID, VISION_START_ID, VISION_END_ID
GRIDS = [(1, 4, 6), (1, 4, 6), (1, 4, 4)]


def tiny_hunyuan_vl() -> Any:
    """HunYuan-VL: a 2-layer vision tower with its merger, 4-axis M-RoPE text layers."""
    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 2, 2, 2]}
    return vlm(
        "HunYuanVL",
        text_config={**_TEXT, "head_dim": 16, "rope_parameters": rope},
        vision_config={
            **_TOWER,
            "num_key_value_heads": 4,
            "patch_size": 2,
            "spatial_merge_size": 2,
            "out_hidden_size": 64,
            "text_hidden_size": 64,
            "max_image_size": 16,
        },
        image_token_id=IMAGE,
    )


class HunYuanFamily(ThwFamily):
    """HunYuan-VL's images, their placeholders and a prompt's media kwargs."""

    name = "hunyuan_vl"
    build = staticmethod(tiny_hunyuan_vl)
    grids = GRIDS
    video_id = None

    def placeholders(self, medium: Medium) -> torch.Tensor:
        _, h, w = medium.grid
        return torch.cat([run(OPEN, 1), run(IMAGE, (h // 2) * (w // 2 + 1) + 2), run(CLOSE, 1)], dim=1)


registry.register_family(HunYuanFamily.name, HunYuanFamily)
