"""Tiny Ernie 4.5 VL (MoE) and its media, as its tests, the family suite and the sweep build them.

Qwen2-VL's patch layout with 2D patches (``t*h*w`` rows of ``3*2*2`` values), a 2x2 spatial
merge and a 2-frame temporal merge: an image is ``h*w/4`` placeholders between image start and
end ids, a video ``t*h*w/8`` between video start and end ids. Its text layers: a dense one, then
one of text and vision experts, chosen per token by the processor's `moe_mm_token_type_ids`.
Ids: images 120, videos 121, image start/end 122/123, video start/end 124/125. Pool seeds 1
and 13 give one layout, other content.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.media.thw import Medium, ThwFamily
from hf_prefix_cache.testing.tiny_vlm_media import run
from hf_prefix_cache.testing.tiny_vlm_parts import _DEPTH_TOWER, _FRAMED_IDS, _TEXT, vlm

IMAGE, VIDEO, IMAGE_START, IMAGE_END, VIDEO_START, VIDEO_END = _FRAMED_IDS.values()
GRIDS = [(1, 4, 6), (1, 4, 6), (1, 2, 4)]
VIDEO_GRIDS = [(2, 4, 4), (2, 4, 4), (4, 2, 2)]


def tiny_ernie4_5_vl() -> Any:
    """Ernie 4.5 VL: a 2-layer vision tower, the resampler, and [dense, text + vision experts] text layers."""
    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [3, 3, 2]}
    experts = {"moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": [32, 16], "moe_num_shared_experts": 1}
    return vlm(
        "Ernie4_5_VLMoe",
        text_config={
            **_TEXT,
            "head_dim": 16,
            "rope_parameters": rope,
            **experts,
            "mlp_layer_types": ["dense", "sparse"],
        },
        vision_config={**_DEPTH_TOWER, "patch_size": 2, "spatial_merge_size": 2, "temporal_merge_size": 2},
        **_FRAMED_IDS,
    )


def expert_marks(ids: torch.Tensor) -> torch.Tensor:
    """The processor's `moe_mm_token_type_ids`: placeholders and their start/end ids, 1 for images, 2 for videos."""
    marks = torch.zeros_like(ids, dtype=torch.int)
    for token_ids, code in (((IMAGE, IMAGE_START, IMAGE_END), 1), ((VIDEO, VIDEO_START, VIDEO_END), 2)):
        for token_id in token_ids:
            marks[ids == token_id] = code
    return marks


class ErnieFamily(ThwFamily):
    """Ernie 4.5 VL's media, their placeholders and a prompt's media kwargs."""

    name = "ernie4_5_vl_moe"
    build = staticmethod(tiny_ernie4_5_vl)
    grids, video_grids = GRIDS, VIDEO_GRIDS

    def placeholders(self, medium: Medium) -> torch.Tensor:
        t, h, w = medium.grid
        if medium.kind == "image":
            return torch.cat([run(IMAGE_START, 1), run(IMAGE, t * h * w // 4), run(IMAGE_END, 1)], dim=1)
        return torch.cat([run(VIDEO_START, 1), run(VIDEO, t * h * w // 8), run(VIDEO_END, 1)], dim=1)

    def token_kwargs(self, ids: torch.Tensor) -> dict[str, Any]:
        """Its token types, and which tokens take the vision experts (`moe_mm_token_type_ids`)."""
        return {**super().token_kwargs(ids), "moe_mm_token_type_ids": expert_marks(ids)}


registry.register_family(ErnieFamily.name, ErnieFamily)
