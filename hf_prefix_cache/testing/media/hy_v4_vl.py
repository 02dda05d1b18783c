"""Tiny HY V4 VL and its media (transformers 5.25 on), as the family suite and the sweep build them.

Qwen2-VL's flattened patch rows with 2D patches (``t*h*w`` rows of ``3*2*2`` values), a 2x2
merge with a newline feature after each merged row: an item of grid ``(t, h, w)`` is one run of
``t * (h/2) * (w/2 + 1)`` placeholders between ids 122/123. Its text layers: HY V4's (MLA with an
indexer over all keys, hyper-connections, experts). Images 120, videos 121. Pool seeds 1 and 13
give one layout, other content.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.media.thw import Medium, ThwFamily
from hf_prefix_cache.testing.tiny_build import _INDEXER, _MLA, _ROUTED_EXPERTS
from hf_prefix_cache.testing.tiny_vlm_media import run
from hf_prefix_cache.testing.tiny_vlm_parts import (
    _MEDIA_IDS,
    _TEXT,
    _TOWER,
    IMAGE_ID,
    VIDEO_ID,
    VISION_END_ID,
    VISION_START_ID,
    vlm,
)

IMAGE, VIDEO, OPEN, CLOSE = IMAGE_ID, VIDEO_ID, VISION_START_ID, VISION_END_ID
GRIDS = [(1, 4, 6), (1, 4, 6), (1, 4, 4)]
VIDEO_GRIDS = [(2, 4, 4), (2, 4, 4), (3, 2, 4)]
_TEXT_LAYERS: dict[str, Any] = {
    **_TEXT,
    **_MLA,
    **_ROUTED_EXPERTS,
    "n_shared_experts": 1,
    "mlp_layer_types": ["dense", "sparse"],
    "layer_types": ["indexed_attention", "indexed_attention"],
    **_INDEXER,
    "indexer_types": ["full", "full"],
    "hc_mult": 4,
    "rope_parameters": {"rope_theta": 1e4, "rope_type": "default", "mrope_section": [1, 1, 2]},
}


def tiny_hy_v4_vl() -> Any:
    """HY V4 VL: a 2-layer vision tower with its merger, HY V4 text layers with M-RoPE."""
    return vlm(
        "HYV4VL",
        text_config=_TEXT_LAYERS,
        vision_config={
            **_TOWER,
            "num_key_value_heads": 4,
            "patch_size": 2,
            "spatial_merge_size": 2,
            "out_hidden_size": 64,
            "max_image_size": 16,
        },
        **_MEDIA_IDS,
    )


class HYV4VLFamily(ThwFamily):
    """HY V4 VL's media, their placeholders and a prompt's media kwargs."""

    name = "hy_v4_vl"
    build = staticmethod(tiny_hy_v4_vl)
    grids, video_grids = GRIDS, VIDEO_GRIDS

    def placeholders(self, medium: Medium) -> torch.Tensor:
        t, h, w = medium.grid
        token = IMAGE if medium.kind == "image" else VIDEO
        return torch.cat([run(OPEN, 1), run(token, t * (h // 2) * (w // 2 + 1)), run(CLOSE, 1)], dim=1)


#: Whether this transformers release has the family (5.25 on).
AVAILABLE = hasattr(transformers, "HYV4VLConfig")
# Registered on 5.23 too (the support matrix there does not sweep the type); its suite row needs 5.25.
registry.register_family(HYV4VLFamily.name, HYV4VLFamily, suite=AVAILABLE)
