"""A tiny random Mllama (cross-attention VLM) and its media, as `MllamaProcessor` would build them.

Vision: 28x28 tiles of 14x14 patches, at most 2 tiles, 5 vision tokens per tile; text: 3 layers,
layer 1 cross-attention, with its tanh gates opened so images change the text states. Media come
from the real `MllamaImageProcessorPil` and the processor's cross-attention mask functions.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
import transformers
from PIL import Image
from transformers.models.mllama.processing_mllama import (
    convert_sparse_cross_attention_mask_to_dense,
    get_cross_attention_token_mask,
)

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.tiny_build import _ATTN, _finalize
from hf_prefix_cache.testing.tiny_models import random_prompt

IMAGE_ID = 120
MAX_TILES = 2
TILE = 28
SUPPRESS = list(range(100, 128))  # answers never contain the image token
SIZES = [(20, 50), (30, 30), (50, 22), (28, 28)]  # (height, width): 2, 1, 2 and 1 tiles


@functools.cache
def tiny_mllama() -> Any:
    """MllamaForConditionalGeneration with one cross-attention layer (index 1 of 3) and open gates."""
    torch.manual_seed(0)
    config = transformers.MllamaConfig(
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_global_layers": 1,
            "attention_heads": 4,
            "image_size": TILE,
            "patch_size": 14,
            "max_num_tiles": MAX_TILES,
            "vision_output_dim": 64,
            "intermediate_layers_indices": [0],
            "supported_aspect_ratios": [[1, 1], [1, 2], [2, 1]],
        },
        text_config={
            **_ATTN,
            "vocab_size": 128,
            "num_hidden_layers": 3,
            "cross_attention_layers": [1],
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": None,
        },
        image_token_index=IMAGE_ID,
    )
    config._attn_implementation = "eager"
    model = transformers.MllamaForConditionalGeneration(config)
    with torch.no_grad():  # the gates start at 0, which would hide the images from the text
        for name, param in model.named_parameters():
            if name.endswith("_gate"):
                param.fill_(0.7)
    return _finalize(model)


@functools.cache
def image_processor() -> Any:
    """The real Mllama image processor (PIL backend) for 28x28 tiles."""
    return transformers.MllamaImageProcessorPil(size={"height": TILE, "width": TILE}, max_image_tiles=MAX_TILES)


def picture(seed: int) -> Image.Image:
    """A random RGB picture of one of `SIZES` (1 or 2 tiles), chosen by `seed`."""
    height, width = SIZES[seed % len(SIZES)]
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def text(n: int, seed: int) -> torch.Tensor:
    """`n` random text tokens (ids below the media ids)."""
    return random_prompt(n, seed=seed)


IMAGE = torch.tensor([[IMAGE_ID]])


def media(ids: torch.Tensor, images: list[Image.Image]) -> dict[str, Any]:
    """What `MllamaProcessor` returns besides the ids: pixels, aspect ratios and the cross-attention mask."""
    out = image_processor()([images], return_tensors="pt")
    spans = get_cross_attention_token_mask(ids[0].tolist(), IMAGE_ID)
    mask = convert_sparse_cross_attention_mask_to_dense([spans], out["num_tiles"], MAX_TILES, ids.shape[1])
    return {
        "pixel_values": out["pixel_values"],
        "aspect_ratio_ids": out["aspect_ratio_ids"],
        "aspect_ratio_mask": out["aspect_ratio_mask"],
        "cross_attention_mask": torch.from_numpy(mask),
    }


def _sweep() -> registry.SweepCase:
    """Mllama (cross-attention) in the support matrix's scenario; a new image reuses nothing: no "c"."""
    seeds = {"a": registry.SEED_A, "b": registry.SEED_B}
    return registry.SweepCase(
        tiny_mllama(), dict.fromkeys(seeds, IMAGE), lambda ids, names: media(ids, [picture(seeds[n]) for n in names])
    )


registry.register_sweep("mllama", _sweep)
