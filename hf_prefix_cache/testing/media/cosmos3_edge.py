"""Tiny Cosmos 3 Edge and its media, as the family suite and the sweep build them.

A SigLIP 2-style tower on 2D patch rows (``t*h*w`` rows of ``3*2*2`` values), a 2x2 merge:
an image is ``h*w/4`` placeholders between vision start and end; a video is written as Qwen3-VL's
(per frame its timestamp text, vision start, ``h*w/4`` placeholders, vision end). Ids as
`tiny_qwen_media`: images 120, videos 121, vision start/end 122/123. Pool seeds 1 and 13 give one
layout, other content.
"""

from __future__ import annotations

from typing import Any

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.media.thw import Qwen3StyleFamily
from hf_prefix_cache.testing.tiny_vlm_parts import _QWEN_IDS, _TEXT, _TOWER, vlm

GRIDS = [(1, 4, 6), (1, 4, 6), (1, 4, 4)]
VIDEO_GRIDS = [(2, 2, 4), (2, 2, 4), (3, 2, 2)]


def tiny_cosmos3_edge() -> Any:
    """Cosmos 3 Edge: a 2-layer SigLIP 2-style tower, its projector, M-RoPE text layers."""
    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}
    return vlm(
        "Cosmos3Edge",
        text_config={**_TEXT, "head_dim": 16, "rope_parameters": rope},
        vision_config={**_TOWER, "patch_size": 2, "num_patches": 16, "spatial_merge_size": 2},
        projector_hidden_size=64,
        **_QWEN_IDS,
    )


class Cosmos3EdgeFamily(Qwen3StyleFamily):
    """Cosmos 3 Edge's media, their placeholders and a prompt's media kwargs."""

    name = "cosmos3_edge"
    build = staticmethod(tiny_cosmos3_edge)
    grids, video_grids = GRIDS, VIDEO_GRIDS


registry.register_family(Cosmos3EdgeFamily.name, Cosmos3EdgeFamily)
