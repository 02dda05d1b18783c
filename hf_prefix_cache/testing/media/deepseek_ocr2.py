"""A tiny DeepSeek-OCR 2 and its pages (a global view and local crops), for its media tests and the sweep.

Its SAM encoder reads 8x8 patches; after its two stride-2 convolutions every view has at most 144
patches, so each view is the tower's 144 learned queries: a page of ``n`` crops is one placeholder
run (120) of ``144 * (n + 1) + 1`` (its crops, its 64x64 global view, the view separator). Its text
layers are DeepSeek-V2-style, the second with experts. Pool seeds 1 and 13 give one 32x32 crop,
other pixels; seed 2 two crops; seed 3 none.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.media.pool import Seeded
from hf_prefix_cache.testing.tiny_build import _ROUTED_EXPERTS
from hf_prefix_cache.testing.tiny_vlm_parts import _SAM, _TEXT, _TOWER, vlm

IMG = 120
QUERIES = 144  # per view: the tower's small query table


@functools.cache
def tiny_deepseek_ocr2() -> Any:
    """DeepSeek-OCR 2: a two-layer SAM encoder (64x64 global views, 32x32 crops), a one-layer query encoder."""
    sam = {**_SAM, "downsample_channels": [16, 32]}
    encoder = {**_TOWER, "num_hidden_layers": 1, "num_key_value_heads": 2}
    text = {
        **_TEXT,
        "max_position_embeddings": 2048,
        "mlp_layer_types": ["dense", "sparse"],
        **_ROUTED_EXPERTS,
        "n_shared_experts": 1,
    }
    return vlm(
        "DeepseekOcr2",
        text_config=text,
        vision_config={"sam_config": sam, "encoder_config": encoder},
        image_token_id=IMG,
    )


class Page(Seeded):
    """A page of pool seed `seed`: its 64x64 global view and its 32x32 crops (1, 2 or none by seed)."""

    def views(self) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        crops = [0, 1, 2][self.seed % 3]
        whole = torch.rand(3, 64, 64, generator=generator) * 2 - 1
        return whole, torch.rand(crops, 3, 32, 32, generator=generator) * 2 - 1


def placeholders(page: Page) -> torch.Tensor:
    crops = page.views()[1].shape[0]
    return torch.full((1, QUERIES * (crops + 1) + 1), IMG, dtype=torch.long)


def media_kwargs(pages: list[Page]) -> dict[str, Any]:
    """What the processor hands `generate`: the global views, every page's crops in order, and crops per page."""
    if not pages:
        return {}
    views = [p.views() for p in pages]
    return {
        "pixel_values": torch.stack([whole for whole, _ in views]),
        "pixel_values_local": torch.cat([crops for _, crops in views]),
        "num_local_patches": torch.tensor([crops.shape[0] for _, crops in views]),
    }


registry.register_single("deepseek_ocr2", tiny_deepseek_ocr2, "image", Page, placeholders, media_kwargs, framing=0)
