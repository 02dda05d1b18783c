"""A tiny Apertus 1.5 and its media (images and audio clips as discrete codes), for its tests and the sweep.

Its VQ image tokenizer encodes each image at its valid size (`image_sizes`; the processor pads a prompt's
images to the largest) into one code per 4x4 pixels (three resolutions), laid out as the processor does:
``<boi>``, then ``h / 4`` rows of ``w / 4`` image ids split by an end-of-line id, then ``<eoi>``. Its
WavTokenizer encoder codes each clip at its valid length (`padding_mask`), one code per started 4
samples, between begin/end-of-audio ids; clips are padded to 40 samples. Codes are text ids (images
100-107, audio 108-115), embedded as the placeholders' features. Pool seeds 1 and 13 give one shape,
other content; seed 2 another (a 16x24 or 8x16 image, a clip of 40 or 26 samples: 10 or 7 codes).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import transformers

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.media.arrays import padded, padded_images, seeded_rand
from hf_prefix_cache.testing.media.pool import PoolMedium, partial
from hf_prefix_cache.testing.tiny_vlm_parts import _TEXT, vlm

IMG, AUD, EOL, BOI, EOI, BOA, EOA = 120, 126, 117, 118, 119, 110, 111
IMAGE_CODES, AUDIO_CODES = 100, 108  # the code ids' offsets: 8 image codes, then 8 audio codes
SIZES = [(16, 24), (16, 24), (8, 16)]
SAMPLES, PADDED, HOP, STRIDE = [40, 40, 26], 40, 4, 4


@functools.cache
def tiny_apertus1p5() -> Any:
    """Apertus 1.5: a VQ image tokenizer (8 codes, 4x4 pixels each), a WavTokenizer encoder (8 codes, 4 samples
    each); Apertus text (2 layers)."""
    vision = {
        "codebook_size": 8,
        "embed_dim": 8,
        "latent_channels": 8,
        "base_channels": 32,
        "channel_multiplier": [1, 1, 1],
        "num_res_blocks": 1,
        "attn_resolutions": [],
        "resolution": 16,
    }
    audio = {
        "model_type": "wavtokenizer_encoder",
        "num_filters": 8,
        "upsampling_ratios": [2, 2],
        "hidden_size": 16,
        "codebook_size": 8,
        "codebook_dim": 16,
        "num_lstm_layers": 1,
    }
    return vlm(
        "Apertus1p5",
        text_config={**_TEXT, "model_type": "apertus1p5_text", "head_dim": 16, "max_position_embeddings": 8192},
        vision_config=vision,
        audio_config=audio,
        image_token_id=IMG,
        audio_token_id=AUD,
        image_token_offset=IMAGE_CODES,
        audio_token_offset=AUDIO_CODES,
    )


class Medium(PoolMedium):
    """An image (its size by seed, `SIZES`) or an audio clip (its valid samples by seed, `SAMPLES`)."""


image, clip = partial(Medium, "image"), partial(Medium, "audio")


def placeholders(medium: Medium) -> torch.Tensor:
    if medium.kind == "audio":
        return torch.tensor([[BOA, *[AUD] * -(-SAMPLES[medium.seed % 3] // HOP), EOA]])
    height, width = SIZES[medium.seed % 3]
    rows = [[IMG] * (width // STRIDE)] * (height // STRIDE)
    return torch.tensor([[BOI, *[t for i, row in enumerate(rows) for t in ([EOL] if i else []) + row], EOI]])


def media_kwargs(media: list[Medium]) -> dict[str, Any]:
    """What the processor hands `generate`: images padded to the prompt's largest with their sizes; clips padded
    to 40 samples with their mask."""
    out: dict[str, Any] = {}
    images = [m for m in media if m.kind == "image"]
    if images:
        sizes = [SIZES[m.seed % 3] for m in images]
        pixels = padded_images([seeded_rand(3, *size, seed=m.seed) for m, size in zip(images, sizes, strict=True)])
        out["pixel_values"], out["image_sizes"] = pixels * 2 - 1, torch.tensor(sizes)
    clips = [m for m in media if m.kind == "audio"]
    if clips:
        rows = [seeded_rand(SAMPLES[m.seed % 3], seed=m.seed) * 2 - 1 for m in clips]
        values, mask = padded(rows, PADDED, torch.int32)
        out["input_values"], out["padding_mask"] = values[:, None], mask
    return out


# Registered on 5.23 too (the support matrix there does not sweep the type); its suite row needs 5.25.
registry.register_mixed(
    "apertus1p5",
    tiny_apertus1p5,
    placeholders,
    media_kwargs,
    {"image": image, "audio": clip},
    suite=hasattr(transformers, "Apertus1p5Config"),
)
