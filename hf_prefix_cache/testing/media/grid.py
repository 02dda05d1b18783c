"""Tiny models and media of the generic table's ``"thw"`` families: flattened patch rows keyed by a ``(t, h, w)`` grid.

Each item is ``t * h * w`` rows of patch values (one row per patch) with its grid row; its
placeholders follow the family's merge (and, where the tower averages a video's frames, one
frame's worth). Framing ids 110/111 around each item; placeholders: image 120, video 121.
Pool seeds 1 and 13 give one layout, other content; seed 2 another layout.

* ``kimi_k25``: Kimi-K2.5 (MoonViT-style tower, 2x2 merge kernel, frames averaged; DeepSeek-V3
  text with MLA and experts): rows ``[3, 4, 4]`` pixels per patch.
* ``minimax_m3_vl``: MiniMax-M3-VL: rows of ``3 * 2 * 4 * 4`` values (2 frames of 4x4 pixels), 2x2 merge;
  every frame counts (``t * h * w / 4`` placeholders).
* ``lfm3_vl``: LFM3-VL: MiniMax-M3-VL's rows and counts; its LFM3 text layers hold conv states.
* ``exaone4_5``: EXAONE 4.5: rows of ``3 * 2 * 2 * 2`` values, 2x2 merge, 1D positions.
* ``hyperclovax_vision_v2``: HyperCLOVA X Vision V2: EXAONE 4.5's rows and counts.
* ``muse_glimmer``: Muse Glimmer: rows of ``2 * 3 * 4 * 4`` values, 2x2 pixel shuffle, windows within each item.
* ``llava_onevision1_5`` (transformers 5.25 on): LLaVA-OneVision-1.5: rows of ``3 * 2 * 2`` values, 2x2 merge,
  a class token per frame, Qwen3 text with 1D positions.
* ``dots3_note``: dots3 Note: rows of ``3 * 2 * 2`` values, 2x2 merge, an expert tower (`dots3_note.py`).
* ``video_llama_3``: Video-LLaMA 3: rows of ``3 * 4 * 4`` pixels, each item's merge size (2) in
  `image_merge_sizes` / `video_merge_sizes`; no video compression mask.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import transformers
from packaging.version import Version

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.media.arrays import seeded_rand
from hf_prefix_cache.testing.media.dots3_note import tiny_dots3_note
from hf_prefix_cache.testing.media.thw import Medium, ThwFamily, grid_kwargs
from hf_prefix_cache.testing.tiny_build import _MLA, _ROUTED_EXPERTS, ModelTable
from hf_prefix_cache.testing.tiny_vlm_parts import (
    _DEPTH_TOWER,
    _MEDIA_IDS,
    _QWEN_TOWER,
    _TEXT,
    _TOWER,
    _build,
    text_config,
    vlm,
)

IMG, VID, OPEN, CLOSE = 120, 121, 110, 111
FAMILIES = (
    "kimi_k25",
    "minimax_m3_vl",
    "lfm3_vl",
    "video_llama_3",
    "exaone4_5",
    "hyperclovax_vision_v2",
    "muse_glimmer",
    *(("llava_onevision1_5",) if hasattr(transformers, "LlavaOnevision15Config") else ()),
    "dots3_note",
)
_IDS: dict[str, Any] = {
    "image_token_id": IMG,
    "video_token_id": VID,
    "vision_start_token_id": 122,
    "vision_end_token_id": 123,
}
_MLA_MOE: dict[str, Any] = {
    "model_type": "deepseek_v3",
    **_MLA,
    **_ROUTED_EXPERTS,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
}


#: Kimi-K2.5's tower: 4x4-pixel patches, 2x2 merge kernel.
_KIMI_VISION: dict[str, Any] = {
    **_TOWER,
    "patch_size": 4,
    "pos_emb_height": 8,
    "pos_emb_width": 8,
    "pos_emb_time": 4,
    "merge_kernel_size": [2, 2],
}


def tiny_kimi_k25() -> Any:
    """Kimi-K2.5: 4x4-pixel patches, 2x2 merge kernel; a video's frames are averaged into one frame's placeholders."""
    return vlm(
        "Kimi_K25", text_config={**_TEXT, **_MLA_MOE}, vision_config=_KIMI_VISION, projection_hidden_size=32, **_IDS
    )


def tiny_minimax_m3_vl() -> Any:
    """MiniMax-M3-VL: a CLIP-like tower (Conv3d patches of 2 frames x 4x4 pixels, 3D RoPE), 2x2 merge; MoE text."""
    text = {
        **_TEXT,
        "model_type": "minimax_m3_vl_text",
        "head_dim": 16,
        "rotary_dim": 16,
        "num_experts_per_tok": 2,
        "num_local_experts": 4,
        "dense_intermediate_size": 128,
        "shared_intermediate_size": 64,
        "index_n_heads": 8,
        "index_head_dim": 16,
    }
    vision = {
        **_TOWER,
        "image_size": 32,
        "patch_size": 4,
        "temporal_patch_size": 2,
        "spatial_merge_size": 2,
    }
    config = transformers.MiniMaxM3VLConfig(
        text_config=text, vision_config=vision, projector_hidden_size=64, image_token_index=IMG, video_token_index=VID
    )
    return _build(transformers.MiniMaxM3SparseForConditionalGeneration, config)


def tiny_lfm3_vl() -> Any:
    """LFM3-VL: a conv + attention tower on flattened patch rows (2 frames x 4x4 pixels), 2x2 merge; LFM3 text
    [conv, full, sliding, conv] (conv states: the hook prefills media prompts itself)."""
    text = {
        **_TEXT,
        "model_type": "lfm3",
        "head_dim": 16,
        "num_hidden_layers": 4,
        "layer_types": ["conv", "full_attention", "sliding_attention", "conv"],
        "sliding_window": 8,
        "conv_L_cache": 3,
    }
    vision = {
        **_TOWER,
        "patch_size": 4,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_key_value_heads": 2,
        "layer_types": ["conv", "full_attention"],
    }
    return vlm("Lfm3Vl", text_config=text, vision_config=vision, projector_hidden_size=64, **_IDS)


def tiny_video_llama_3() -> Any:
    """Video-LLaMA 3: a SigLIP-style tower on flattened 4x4-pixel patch rows; images merge 2x2, videos 2x2 too here."""
    vision = {
        **_TOWER,
        "patch_size": 4,
    }
    return vlm("VideoLlama3", text_config=text_config("qwen2"), vision_config=vision, **_MEDIA_IDS)


#: EXAONE 4.5's and HyperCLOVA X Vision V2's Qwen2.5-VL-style tower: window blocks, then a full one.
_QWEN2_5_TOWER: dict[str, Any] = {"depth": 2, **_QWEN_TOWER, "window_size": 8, "fullatt_block_indexes": [1]}


def tiny_exaone4_5() -> Any:
    """EXAONE 4.5: a Qwen2.5-VL-style tower (window + full blocks) on flattened 2x2x2 patch rows, 2x2 merge;
    EXAONE 4 text [sliding, full] with 1D positions."""
    text = {**_TEXT, "model_type": "exaone4", "head_dim": 16, "sliding_window": 8}
    text["layer_types"] = ["sliding_attention", "full_attention"]
    vision = {**_QWEN2_5_TOWER, "num_key_value_heads": 4}
    return vlm("Exaone4_5_", text_config=text, vision_config=vision, image_token_id=IMG, video_token_id=VID)


def tiny_hyperclovax_vision_v2() -> Any:
    """HyperCLOVA X Vision V2: EXAONE 4.5's Qwen2.5-VL-style tower and rows, 2x2 merge; HyperCLOVA X text,
    1D positions (its generate drops position ids)."""
    text = text_config("hyperclovax", head_dim=16)
    return vlm("HyperCLOVAXVisionV2", text_config=text, vision_config=_QWEN2_5_TOWER, **_MEDIA_IDS)


#: Muse Glimmer's windowed tower (Muse Spark's too): 4x4-pixel patches, a 4x4 position table, 2x2 pixel shuffle.
MUSE_GLIMMER_VISION: dict[str, Any] = {
    **_TOWER,
    "patch_size": 4,
    "pos_emb_height": 4,
    "pos_emb_width": 4,
    "merge_size": 2,
}


def tiny_muse_glimmer() -> Any:
    """Muse Glimmer: a windowed tower (16-pixel windows within each item) on flattened 2-frame 4x4-pixel patch
    rows, 2x2 pixel shuffle; text [sliding x 3, full] with NoPE full layers."""
    text = {**_TEXT, "model_type": "muse_glimmer_text", "head_dim": 16, "sliding_window": 8, "num_hidden_layers": 4}
    return vlm(
        "MuseGlimmer",
        text_config=text,
        vision_config=MUSE_GLIMMER_VISION,
        **_MEDIA_IDS,
        out_hidden_size=128,
        projector_hidden_size=64,
    )


def tiny_llava_onevision1_5() -> Any:
    """LLaVA-OneVision-1.5: a RICE-ViT tower (a class token per frame, attention within it) on flattened 2x2 patch
    rows, 2x2 merge; Qwen3 text with 1D positions."""
    vision = {
        **_DEPTH_TOWER,
        "patch_size": 2,
        "spatial_merge_size": 2,
        "out_hidden_size": 64,
    }
    return vlm("LlavaOnevision15", text_config=text_config("qwen3", head_dim=16), vision_config=vision, **_IDS)


_BUILDERS = ModelTable(
    {
        "llava_onevision1_5": tiny_llava_onevision1_5,
        "exaone4_5": tiny_exaone4_5,
        "hyperclovax_vision_v2": tiny_hyperclovax_vision_v2,
        "muse_glimmer": tiny_muse_glimmer,
        "kimi_k25": tiny_kimi_k25,
        "minimax_m3_vl": tiny_minimax_m3_vl,
        "lfm3_vl": tiny_lfm3_vl,
        "video_llama_3": tiny_video_llama_3,
        "dots3_note": tiny_dots3_note,
    }
)
#: Per family: the shape of one patch row.
_ROW = {
    "kimi_k25": (3, 4, 4),
    "minimax_m3_vl": (3 * 2 * 4 * 4,),
    "lfm3_vl": (3 * 2 * 4 * 4,),
    "video_llama_3": (3 * 4 * 4,),
    "exaone4_5": (3 * 2 * 2 * 2,),
    "hyperclovax_vision_v2": (3 * 2 * 2 * 2,),
    "muse_glimmer": (2 * 3 * 4 * 4,),
    "llava_onevision1_5": (3 * 2 * 2,),
    "dots3_note": (3 * 2 * 2,),
}
#: Per family: patches merged into one placeholder, and whether a video's frames are averaged.
_MERGE = {
    "kimi_k25": (4, True),
    "minimax_m3_vl": (4, False),
    "lfm3_vl": (4, False),
    "video_llama_3": (4, False),
    "exaone4_5": (4, False),
    "hyperclovax_vision_v2": (4, False),
    "muse_glimmer": (4, False),
    "llava_onevision1_5": (4, False),
    "dots3_note": (4, False),
}
#: Families that take each item's merge size as a kwarg (`*_merge_sizes`), all 2 here.
_OWN_MERGES = ("video_llama_3",)
#: Families whose text layers hold states: a prefix restores only at a snapshot.
STATE_FAMILIES = ("lfm3_vl",)
GRIDS = [(1, 4, 6), (1, 4, 6), (1, 2, 4)]
VIDEO_GRIDS = [(2, 2, 4), (2, 2, 4), (4, 2, 2)]
#: transformers 5.23's Kimi-K2.5 splits its frame-averaged video features by ``t * h * w`` (a cold
#: run fails for ``t > 1``): there its videos have one frame.
_ONE_FRAME = {"kimi_k25"} if Version(transformers.__version__) < Version("5.24") else set()


#: One model per family per session.
cached_grid = _BUILDERS.one


class GridFamily(ThwFamily):
    """Builds one family's media, their placeholders and a prompt's media kwargs."""

    grids, video_grids = GRIDS, VIDEO_GRIDS
    image_id = video_id = None  # no token types
    longer = repeat = False

    def __init__(self, name: str) -> None:
        self.name = name
        self.model = cached_grid(name)
        self.states = name in STATE_FAMILIES

    def video(self, seed: int) -> Medium:
        t, h, w = VIDEO_GRIDS[seed % 3]
        return Medium("video", seed, (1 if self.name in _ONE_FRAME else t, h, w))

    def count(self, medium: Medium) -> int:
        merge, pooled = _MERGE[self.name]
        t, h, w = medium.grid
        return (1 if pooled else t) * h * w // merge

    def placeholders(self, medium: Medium) -> torch.Tensor:
        token = IMG if medium.kind == "image" else VID
        return torch.tensor([[OPEN, *[token] * self.count(medium), CLOSE]])

    def rows(self, medium: Medium) -> torch.Tensor:
        t, h, w = medium.grid
        return seeded_rand(t * h * w, *_ROW[self.name], seed=medium.seed)

    def kwargs(self, ids: torch.Tensor, media: list[Medium]) -> dict[str, Any]:
        """What the processor hands `generate` for `media` in prompt order (with each item's merge size where the
        family takes it)."""
        out = grid_kwargs(media, self.rows)
        if self.name in _OWN_MERGES:
            for kind in ("image", "video"):
                mine = [m for m in media if m.kind == kind]
                if mine:
                    out[f"{kind}_merge_sizes"] = torch.tensor([2] * len(mine))
        return out


# The sweep case of a type newer than this release is registered too (built only when the support matrix,
# which sweeps the release's own types, runs it), as every family the media registry serves has one.
for _name in dict.fromkeys((*FAMILIES, "llava_onevision1_5")):
    registry.register_family(_name, partial(GridFamily, _name), suite=_name in FAMILIES)
