"""Tiny Qwen3.5 (dense, MoE), Qwen3-VL-MoE, Cohere Compass and Cosmos 3 Omni models and their media.

As their media tests and the sweep build them. All five take Qwen2-VL's patch layout (``t*h*w`` flattened rows of ``3*2*2*2`` values per item,
2x2 merge: ``t*h*w/4`` placeholders) and write a video as Qwen3-VL does: per frame its
timestamp text, vision start, ``h*w/4`` placeholders, vision end (`tiny_qwen_media`). Qwen3.5's
text layers alternate gated delta-net (recurrent state) and full attention, with interleaved
M-RoPE; Qwen3-VL-MoE is Qwen3-VL (deepstack) with expert layers; Cohere Compass is Qwen3-VL's
tower and M-RoPE on Cohere 2 text layers (sliding layers with rope, a full layer without), and
Cosmos 3 Omni is Qwen3-VL under its own config. Ids as `tiny_vlms`: images
120, videos 121, vision start/end 122/123. Pool seeds 1 and 13 give one layout, other content.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.media.thw import Medium, Qwen3StyleFamily
from hf_prefix_cache.testing.tiny_build import _GATED_DELTA, ModelTable
from hf_prefix_cache.testing.tiny_qwen_media import patches
from hf_prefix_cache.testing.tiny_vlm_parts import _QWEN_IDS, _QWEN_TOWER, _TEXT, vlm

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_vl_moe", "cohere_compass", "cosmos3_omni")
#: Families whose text layers hold recurrent states.
HYBRID = ("qwen3_5", "qwen3_5_moe")
GRIDS = [(1, 4, 6), (1, 4, 6), (1, 2, 4)]
VIDEO_GRIDS = [(2, 2, 4), (2, 2, 4), (3, 2, 2)]

_ROPE = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3], "mrope_interleaved": True}
_VISION: dict[str, Any] = {"depth": 2, **_QWEN_TOWER, "num_position_embeddings": 64}
_IDS = _QWEN_IDS
_HYBRID_TEXT: dict[str, Any] = {
    **_TEXT,
    "head_dim": 16,
    "rope_parameters": {**_ROPE, "partial_rotary_factor": 1.0},
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "linear_conv_kernel_dim": 4,
    **_GATED_DELTA,
}
_MOE = {"moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}


def tiny_qwen3_5() -> Any:
    """Qwen3.5: [gated delta-net, full attention] x 2 text layers, Qwen3-VL-style tower without deepstack."""
    return vlm("Qwen3_5", text_config=_HYBRID_TEXT, vision_config=_VISION, **_IDS)


def tiny_qwen3_5_moe() -> Any:
    """Qwen3.5-MoE: Qwen3.5 with expert MLPs."""
    return vlm("Qwen3_5Moe", text_config={**_HYBRID_TEXT, **_MOE}, vision_config=_VISION, **_IDS)


def tiny_qwen3_vl_moe() -> Any:
    """Qwen3-VL-MoE: Qwen3-VL (interleaved M-RoPE, deepstack) with expert MLPs."""
    text = {**_TEXT, "head_dim": 16, "rope_parameters": _ROPE, **_MOE, "decoder_sparse_step": 1}
    text.pop("shared_expert_intermediate_size")
    vision = {**_VISION, "deepstack_visual_indexes": [0]}
    return vlm("Qwen3VLMoe", text_config=text, vision_config=vision, **_IDS)


def tiny_cohere_compass() -> Any:
    """Cohere Compass: Qwen3-VL's tower (deepstack) and interleaved M-RoPE on Cohere 2 layers (sliding + NoPE full)."""
    text = {
        **_TEXT,
        "head_dim": 16,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 128,
        "rope_parameters": {"sliding_attention": _ROPE, "full_attention": None},
    }
    vision = {**_VISION, "deepstack_visual_indexes": [0]}
    return vlm("CohereCompass", text_config=text, vision_config=vision, **_IDS)


def tiny_cosmos3_omni() -> Any:
    """Cosmos 3 Omni (its reasoner): Qwen3-VL's architecture under its own config."""
    text = {**_TEXT, "head_dim": 16, "rope_parameters": _ROPE}
    vision = {**_VISION, "deepstack_visual_indexes": [0]}
    return vlm("Cosmos3Omni", text_config=text, vision_config=vision, **_IDS)


_BUILDERS = ModelTable(
    {
        "qwen3_5": tiny_qwen3_5,
        "qwen3_5_moe": tiny_qwen3_5_moe,
        "qwen3_vl_moe": tiny_qwen3_vl_moe,
        "cohere_compass": tiny_cohere_compass,
        "cosmos3_omni": tiny_cosmos3_omni,
    }
)


#: One model per family per session.
cached_qwen3 = _BUILDERS.one


class Qwen3Family(Qwen3StyleFamily):
    """Builds one family's media, their placeholders and a prompt's media kwargs."""

    grids, video_grids = GRIDS, VIDEO_GRIDS

    def __init__(self, name: str) -> None:
        self.name = name
        self.model = cached_qwen3(name)
        self.states = name in HYBRID

    def rows(self, medium: Medium) -> torch.Tensor:
        return patches(medium.seed, medium.grid)


for _name in FAMILIES:
    registry.register_family(_name, partial(Qwen3Family, _name))
