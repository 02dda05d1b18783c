"""A tiny Inkling 2 and Inkling 2 Loop and their images (one patch row per placeholder), for their tests and the sweep.

Both towers take an image as one row of ``4 x 4 x 3`` pixels (2x2 patches of 2x2 pixels, merged) per
placeholder, with its ``(1, h, w)`` grid counted in placeholders; attention runs within each image (a
class token in front of each). The text layers are hybrid [sliding, full] with conv states and experts;
Inkling 2 Loop (transformers 5.25 on) runs its last two layers twice. An image is
``110 [placeholders] 111``; pool seeds 1 and 13 give one grid, other pixels, seed 2 another grid.
"""

from __future__ import annotations

import functools
from functools import partial
from typing import Any

import torch
import transformers

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.media.pool import Seeded
from hf_prefix_cache.testing.tiny_build import _INKLING_ATTENTION, _ROUTED_EXPERTS
from hf_prefix_cache.testing.tiny_vlm_parts import _TOWER, _build

IMG, OPEN, CLOSE = 120, 110, 111
GRIDS = [(1, 2, 3), (1, 2, 3), (1, 2, 2)]
#: Each family's model type -> the name transformers gives its classes (the loop variant is new in 5.25).
FAMILIES = {
    "inkling2": "Inkling2",
    **({"inkling2_loop": "Inkling2Loop"} if hasattr(transformers, "Inkling2LoopConfig") else {}),
}
_TEXT: dict[str, Any] = {
    "vocab_size": 128,
    "unpadded_vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    **_INKLING_ATTENTION,
    "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
    **_ROUTED_EXPERTS,
    "n_layers_per_attn_res_block": 2,
    "rel_extent": 64,
    "d_rel": 8,
    "pad_token_id": 0,
    "eos_token_id": None,
}
_VISION = {
    **_TOWER,
    "patch_size": 2,
    "spatial_merge_size": 2,
    "posemb_grid_size": 4,
    "projection_hidden_dim": 64,
    "text_hidden_size": 64,
}
_LOOP = {"loop_layer_index_start": 2, "loop_layer_index_end": 4, "loop_num_passes": 2, "loop_gate_rank": 8}


@functools.cache
def tiny_inkling2(model_type: str) -> Any:
    """Inkling 2 (or its loop variant): a ViT per image on merged 2x2-patch rows; 4 hybrid text layers."""
    name = FAMILIES[model_type]
    text = {**_TEXT, **(_LOOP if model_type == "inkling2_loop" else {})}
    config = getattr(transformers, f"{name}Config")(text_config=text, vision_config=_VISION, image_token_id=IMG)
    return _build(getattr(transformers, f"{name}ForConditionalGeneration"), config)


class Medium(Seeded):
    @property
    def grid(self) -> tuple[int, int, int]:
        return GRIDS[self.seed % 3]


def image(seed: int) -> Medium:
    return Medium(seed)


def placeholders(medium: Medium) -> torch.Tensor:
    t, h, w = medium.grid
    return torch.tensor([[OPEN, *[IMG] * (t * h * w), CLOSE]])


def media_kwargs(media: list[Medium]) -> dict[str, Any]:
    """What the processor hands `generate`: every image's rows in [-1, 1], one per placeholder, and its grid."""
    rows = [
        torch.rand(m.grid[0] * m.grid[1] * m.grid[2], 4, 4, 3, generator=torch.Generator().manual_seed(m.seed)) * 2 - 1
        for m in media
    ]
    return {"pixel_values": torch.cat(rows), "image_grid_thw": torch.tensor([list(m.grid) for m in media])}


# Inkling 2 Loop's sweep case is registered on 5.23 too (the support matrix there does not sweep the type).
for _model_type in ("inkling2", "inkling2_loop"):
    registry.register_mixed(
        _model_type,
        partial(tiny_inkling2, _model_type),
        placeholders,
        media_kwargs,
        {"image": image},
        ("image", "image", "image"),
        states=True,
        suite=_model_type in FAMILIES,
    )
