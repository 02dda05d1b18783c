"""Tiny models and images of the generic table's ``"packed"`` families: NaViT-packed patches keyed by their grid.

All images of a prompt are one ``[1, 3, p, L]`` row, each image's ``h * w`` patches (``p = 4``
pixels square) side by side, `target_sizes` their ``(h, w)`` grids; an image's placeholders
follow the family's merges. Framing ids 110/111 around each image; placeholder 120. Pool seeds 1
and 13 give one grid, other content; seed 2 another grid. Text: Qwen3.5's [gated delta-net,
full attention] x 2 layers, so the hook prefills media prompts itself.

* ``minicpm_ocr``: MiniCPM-o OCR, "4x" mode: a 2x2 merger, ``h * w / 4`` placeholders.
* ``minicpmv4_6``: MiniCPM-V 4.6, its media cold (16x mode, `generic_table.COLD_FAMILIES`):
  built with ``cached_packed("minicpmv4_6", "16x")`` to show why.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import transformers

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.media.cases import MediaCase, ignore_ids
from hf_prefix_cache.testing.media.qwen3 import _HYBRID_TEXT
from hf_prefix_cache.testing.tiny_vlm_parts import _TOWER, _build

IMG, OPEN, CLOSE = 120, 110, 111
PATCH = 4
FAMILIES = ("minicpm_ocr",)
_VISION = {
    **_TOWER,
    "image_size": 32,
    "patch_size": PATCH,
    "insert_layer_id": 0,
}
#: Per family: its classes, patches per placeholder and pool grids (seeds 0 and 1 alike).
_FAMILY = {
    "minicpm_ocr": (
        transformers.MiniCPMOcrConfig,
        transformers.MiniCPMOcrForConditionalGeneration,
        4,
        [(4, 6), (4, 6), (2, 4)],
    ),
    "minicpmv4_6": (
        transformers.MiniCPMV4_6Config,
        transformers.MiniCPMV4_6ForConditionalGeneration,
        4,
        [(4, 6), (4, 6), (2, 4)],
    ),
}


@functools.cache
def cached_packed(name: str, mode: str = "4x") -> Any:
    config_cls, model_cls, _, _ = _FAMILY[name]
    config = config_cls(
        text_config={**_HYBRID_TEXT, "model_type": "qwen3_5_text"},
        vision_config=_VISION,
        image_token_id=IMG,
        video_token_id=121,
        downsample_mode=mode,
    )
    return _build(model_cls, config)


@dataclass(frozen=True)
class Image:
    """One image: its seed and ``(h, w)`` patch grid."""

    seed: int
    grid: tuple[int, int]


class PackedFamily:
    """Builds one family's images, their placeholders and a prompt's media kwargs."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.model = cached_packed(name)
        self.merge, self.grids = _FAMILY[name][2], _FAMILY[name][3]

    def image(self, seed: int) -> Image:
        return Image(seed, self.grids[seed % 3])

    def count(self, image: Image) -> int:
        return image.grid[0] * image.grid[1] // self.merge

    def placeholders(self, image: Image) -> torch.Tensor:
        return torch.tensor([[OPEN, *[IMG] * self.count(image), CLOSE]])

    def columns(self, image: Image) -> torch.Tensor:
        """The image's patches as packed columns ``[3, p, h * w * p]``."""
        h, w = image.grid
        return torch.rand(3, PATCH, h * w * PATCH, generator=torch.Generator().manual_seed(image.seed))

    def kwargs(self, images: list[Image]) -> dict[str, Any]:
        """What the processor hands `generate` for `images` in prompt order."""
        if not images:
            return {}
        return {
            "pixel_values": torch.cat([self.columns(i) for i in images], dim=-1)[None],
            "target_sizes": torch.tensor([list(i.grid) for i in images], dtype=torch.int32),
        }


def _sweep(name: str) -> registry.SweepCase:
    """A ``"packed"`` table family in the support matrix's scenario: A an image; C another image."""
    fam = PackedFamily(name)
    media = registry.three(fam.image)
    tokens = {k: fam.placeholders(m) for k, m in media.items()}
    return registry.SweepCase(fam.model, tokens, lambda _ids, names: fam.kwargs([media[n] for n in names]), first=1)


for _name in FAMILIES:
    registry.register_sweep(_name, partial(_sweep, _name))


def _suite(name: str) -> MediaCase:
    fam = PackedFamily(name)
    return MediaCase(name, fam.model, {"image": fam.image}, fam.placeholders, ignore_ids(fam.kwargs), states=True)


for _name in FAMILIES:
    registry.register_suite(_name, partial(_suite, _name))
