"""Ovis2.5's tiny model and media (transformers 5.25 on): the ``"thw"`` families' rows, each item framed.

The model is `tiny_525.tiny_ovis2_5`: flattened rows of ``3 * 2 * 2`` values (2x2 patches, one frame
each), a 2x2 merge. An image is ``image_start`` (122), ``t * h * w / 4`` placeholders (120) and
``image_end`` (123); a video likewise with 124, 121 and 125. Images and videos take the grids of
`grid.py`, and its seeds: 1 and 13 one layout, other content; 2 another layout.
"""

from __future__ import annotations

import functools
from functools import partial
from typing import Any

import torch
import transformers

from hf_prefix_cache.testing import tiny_525
from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.media.cases import MediaCase
from hf_prefix_cache.testing.media.grid import GridFamily
from hf_prefix_cache.testing.media.thw import Medium

#: The family, where this transformers release has it.
FAMILIES = ("ovis2_5",) if hasattr(transformers, "Ovis2_5Config") else ()
_FRAMES = {
    "image": (tiny_525.OVIS_IMAGE_START, tiny_525.OVIS_IMAGE, tiny_525.OVIS_IMAGE_END),
    "video": (tiny_525.OVIS_VIDEO_START, tiny_525.OVIS_VIDEO, tiny_525.OVIS_VIDEO_END),
}


@functools.cache
def cached_ovis2_5() -> Any:
    return tiny_525.tiny_ovis2_5()


class Ovis25Family(GridFamily):
    """Ovis2.5's media: `GridFamily`'s grids and kwargs, its own rows and framed placeholders."""

    def __init__(self, name: str = "ovis2_5") -> None:
        self.name = name
        self.model = cached_ovis2_5()

    def count(self, medium: Medium) -> int:
        t, h, w = medium.grid
        return t * h * w // 4

    def placeholders(self, medium: Medium) -> torch.Tensor:
        start, token, end = _FRAMES[medium.kind]
        return torch.tensor([[start, *[token] * self.count(medium), end]])

    def rows(self, medium: Medium) -> torch.Tensor:
        t, h, w = medium.grid
        return torch.rand(t * h * w, 3 * 2 * 2, generator=torch.Generator().manual_seed(medium.seed))


def _sweep() -> registry.SweepCase:
    """The support matrix's scenario: A an image; C an image, text, then a video."""
    fam = Ovis25Family()
    # The start id is the item's first position, not text before it.
    return registry.mixed_sweep(
        fam.model, fam.placeholders, registry.mixed(fam.image, fam.image, fam.video), fam.kwargs, first=0
    )


def _suite(name: str) -> MediaCase:
    fam = Ovis25Family(name)
    media = {"image": fam.image, "video": fam.video}
    return MediaCase(name, fam.model, media, fam.placeholders, fam.kwargs, framing=lambda _medium: 0)


# The sweep case on every release (as every family the media registry serves has one; the support matrix
# builds it only where the release has the type), the suite's where the release has the type.
registry.register_sweep("ovis2_5", _sweep)
for _name in FAMILIES:
    registry.register_suite(_name, partial(_suite, _name))
