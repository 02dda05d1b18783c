"""Inkling's images and audio clips (a generic-table row with suffix embeddings) are served exactly.

Its vision tower encodes each patch row on its own into one placeholder (so every patch is an
item), and an audio clip is a row of dMel bin ids with one placeholder per valid frame. Its
hybrid text layers hold conv states, so the hook prefills media prompts itself from suffix
embeddings. Every request runs cold and through the store: equal tokens, logits within 1e-4, all
media passed every time as the processor would. Its served requests are rows of the family suite
(`test_media_families.py`); this file checks what the generic adapter assumes of its tower.
"""

from __future__ import annotations

import torch

from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.multimodal.generic import GenericMedia
from hf_prefix_cache.testing.media.inkling import (
    image,
    media_kwargs,
    tiny_inkling,
)


def test_the_generic_adapter_serves_it() -> None:
    assert isinstance(media_adapter_for(tiny_inkling()), GenericMedia)


def test_the_tower_encodes_each_patch_on_its_own() -> None:
    model = tiny_inkling()
    rows = media_kwargs([image(1), image(2)])["pixel_values"]
    with torch.no_grad():
        together = model.model.get_image_features(rows).pooler_output
        alone = torch.cat([model.model.get_image_features(rows[i : i + 1]).pooler_output for i in range(len(rows))])
    torch.testing.assert_close(alone, together, rtol=0, atol=1e-5)
