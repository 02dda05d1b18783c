"""A tiny Emu3 and its images, for its media tests and the sweep.

Its VQ-VAE has two levels (``f = 2`` pixels per code side), a 16-code codebook whose codes are
text ids 64-79, and an end-of-line code 114. An image of ``h x w`` pixels is written as the
processor writes it: begin-of-image 110, a wrapper id 112, ``(h / 2) * (w / 2 + 1)``
placeholders 120, then end-of-frame 113 and end-of-image 115 (the processor's size text
between 110 and 112 is left out). A prompt's images are padded to its largest, `image_sizes`
their valid sizes. Pool seeds 1 and 13 give one size, other pixels.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.media.arrays import padded_images, seeded_rand
from hf_prefix_cache.testing.media.pool import Seeded
from hf_prefix_cache.testing.tiny_vlm_parts import _TEXT, vlm

IMG, BOI, WRAPPER, EOF, EOL, EOI = 120, 110, 112, 113, 114, 115
FACTOR = 2
NEW = 4
SPECIAL_IDS = list(range(100, 128))
#: Image sizes per pool seed (seeds 1 and 13 alike).
SIZES = [(8, 12), (8, 12), (12, 8)]
_VOCAB = {"<image>": IMG, "<|extra_200|>": EOL, **{f"<|visual token {i:06d}|>": 64 + i for i in range(16)}}
_VQ = {
    "codebook_size": 16,
    "embed_dim": 4,
    "latent_channels": 4,
    "base_channels": 32,
    "channel_multiplier": [1, 2],
    "num_res_blocks": 1,
    "attn_resolutions": [1],
    "hidden_size": 64,
    "num_attention_heads": 1,
}


@functools.cache
def tiny_emu3() -> Any:
    """Emu3: a two-level VQ-VAE (attention at its second level) and a 2-layer text model."""
    return vlm("Emu3", vq_config=_VQ, text_config=dict(_TEXT), vocabulary_map=_VOCAB)


class Image(Seeded):
    @property
    def size(self) -> tuple[int, int]:
        return SIZES[self.seed % 3]

    def pixels(self) -> torch.Tensor:
        return seeded_rand(3, *self.size, seed=self.seed) * 2 - 1


def placeholders(image: Image) -> torch.Tensor:
    height, width = image.size
    count = (height // FACTOR) * (width // FACTOR + 1)
    return torch.tensor([[BOI, WRAPPER, *[IMG] * count, EOF, EOI]])


def media_kwargs(images: list[Image]) -> dict[str, Any]:
    """What the processor hands `generate`: the images padded (bottom, right) to the largest, their sizes."""
    if not images:
        return {}
    pixels = padded_images([i.pixels() for i in images])
    return {"pixel_values": pixels, "image_sizes": torch.tensor([list(i.size) for i in images])}


# The sweep's C is another image of A's size, so A keeps its padding.
_SWEEP_MEDIA = {"a": Image(registry.SEED_A), "b": Image(registry.SEED_B), "c": Image(registry.SEED_A + 3)}
registry.register_single("emu3", tiny_emu3, "image", Image, placeholders, media_kwargs, framing=2, media=_SWEEP_MEDIA)
