"""A tiny Ovis2 and its images (a global view, then tiles), for its media tests and the sweep.

Its tower reads 8x8 rows in 2x2 patches, merged 2x2 (`hidden_stride`): 4 placeholders (120) per
row. An image is written as its processor writes it: start indicator 110, its global view's
placeholders, grid indicator 111, then (for a tiled image) each tile's placeholders with column
indicators 112 between tiles of a row and row indicators 113 between rows, and end indicator 114.
Pool seeds 1 and 13 give one tiling, other pixels; seed 2 a 1x2 tiling.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.media.pool import Seeded
from hf_prefix_cache.testing.tiny_vlm_parts import _TEXT, _TOWER_8PX, text_config, vlm

IMG, START, GRID, COL, ROW, END = 120, 110, 111, 112, 113, 114
PER_ROW = 4
NEW = 4
SPECIAL_IDS = list(range(100, 128))
#: Tile grids (rows, columns) per pool seed (seeds 1 and 13 alike); (1, 1): the global view only.
GRIDS = [(1, 1), (1, 1), (1, 2)]


@functools.cache
def tiny_ovis2() -> Any:
    """Ovis2: a one-layer tower on 8x8 rows (2x2 patches, 2x2 merge) into 24 visual tokens (5 indicators)."""
    return vlm(
        "Ovis2",
        vision_config={**_TOWER_8PX, "vocab_size": 24, "hidden_stride": 2},
        text_config=text_config("qwen2"),
        image_token_id=IMG,
        visual_indicator_token_ids=[START, GRID, COL, ROW, END],
        vocab_size=_TEXT["vocab_size"],
        hidden_size=_TEXT["hidden_size"],
    )


class Image(Seeded):
    @property
    def grid(self) -> tuple[int, int]:
        return GRIDS[self.seed % 3]

    def rows(self) -> torch.Tensor:
        """Its global view, then its tiles (none for a 1x1 grid)."""
        rows, cols = self.grid
        count = 1 + (rows * cols if rows * cols > 1 else 0)
        return torch.rand(count, 3, 8, 8, generator=torch.Generator().manual_seed(self.seed)) * 2 - 1


def placeholders(image: Image) -> torch.Tensor:
    rows, cols = image.grid
    tokens = [START, *[IMG] * PER_ROW, GRID]
    if rows * cols > 1:
        for r in range(rows):
            for c in range(cols):
                tokens += [IMG] * PER_ROW + ([COL] if c < cols - 1 else [])
            tokens += [ROW] if r < rows - 1 else []
    return torch.tensor([[*tokens, END]])


def media_kwargs(images: list[Image]) -> dict[str, Any]:
    """What the processor hands `generate`: every image's rows, in prompt order."""
    return {"pixel_values": torch.cat([i.rows() for i in images])} if images else {}


registry.register_single("ovis2", tiny_ovis2, "image", Image, placeholders, media_kwargs, framing=0)
