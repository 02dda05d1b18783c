"""A tiny GraniteDocling and its pages (one or two 32x32 tiles), for its media tests and the sweep.

Its SigLIP-style tower reads 8x8 patches; the connector's pixel shuffle (factor 2) makes 4
placeholders (120) per tile on the coarse path and 16 on the fine path (factor 1, the call's
`tile_fine_mask`), each tile after its processor's framing: the fake-image id 110 and a
row/column marker (111 on). DeepStack features from both tower layers are added at the
placeholders after the first two text layers. Pool seeds 1 and 13 give one tile, other pixels;
seed 2 two tiles.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.media.cases import single
from hf_prefix_cache.testing.tiny_vlm_parts import _TEXT, _TOWER, vlm

IMG, FAKE, MARK = 120, 110, 111
#: Placeholders per tile: the coarse path (pixel shuffle 2), the fine path (four times as many).
COARSE, FINE = 4, 16


@functools.cache
def tiny_granite_docling() -> Any:
    """GraniteDocling: a two-layer tower on 32x32 tiles (8x8 patches), both layers' DeepStack features, Granite text."""
    vision = {
        **_TOWER,
        "image_size": 32,
        "patch_size": 8,
        "out_hidden_size": _TEXT["hidden_size"],
        "scale_factor": 2,
        "deepstack_visual_indexes": [0, 1],
    }
    return vlm(
        "GraniteDocling",
        text_config=_TEXT,
        vision_config=vision,
        image_token_id=IMG,
        pad_token_id=_TEXT["pad_token_id"],
    )


@dataclass(frozen=True)
class Page:
    """A page of pool seed `seed`: one tile, or two (seed 2); `fine` takes the fine connector path."""

    seed: int
    fine: bool = False

    def tiles(self) -> torch.Tensor:
        count = 2 if self.seed % 3 == 2 else 1
        return torch.rand(count, 3, 32, 32, generator=torch.Generator().manual_seed(self.seed)) * 2 - 1


def placeholders(page: Page) -> torch.Tensor:
    """Each tile framed as the processor frames it: the fake-image id, its row/column marker, its placeholders."""
    per_tile = FINE if page.fine else COARSE
    tokens = [t for i in range(page.tiles().shape[0]) for t in (FAKE, MARK + i, *[IMG] * per_tile)]
    return torch.tensor([[*tokens, FAKE]])


def media_kwargs(pages: list[Page]) -> dict[str, Any]:
    """What the processor hands `generate`: every tile in prompt order, each marked real; the fine route if asked."""
    if not pages:
        return {}
    tiles = torch.cat([p.tiles() for p in pages])[None]
    out = {"pixel_values": tiles, "pixel_attention_mask": torch.ones(tiles.shape[:2], dtype=torch.bool)}
    if any(p.fine for p in pages):
        out["tile_fine_mask"] = torch.ones(1, dtype=torch.bool)
    return out


def _sweep() -> registry.SweepCase:
    """GraniteDocling in the support matrix's scenario: A a one-tile page, C a two-tile page."""
    media = registry.three(Page)
    tokens = {k: placeholders(m) for k, m in media.items()}
    return registry.SweepCase(
        tiny_granite_docling(), tokens, lambda _ids, names: media_kwargs([media[n] for n in names]), first=2
    )


registry.register_sweep("granite_docling", _sweep)
registry.register_suite(
    "granite_docling",
    lambda: single("granite_docling", tiny_granite_docling(), "image", Page, placeholders, media_kwargs, framing=2),
)
