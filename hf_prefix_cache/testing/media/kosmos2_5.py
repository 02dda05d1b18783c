"""A tiny Kosmos-2.5 and its prompts (the image always first), for its media tests and the sweep.

Its tower reads 16 flattened 2x2 patches (``[1, 16, 2 + 12]``: row and column ids, then the
values); a projection turns them into 4 latent queries, the image's placeholders. A prompt is
as its processor builds it: BOS 0, image start 110, 4 image ids 120, image end 111, then text;
`image_embeds_position_mask` is ``[0, -1, 1, 1, 1, 1, -1, 0, ...]``. Pool seeds 1 and 13 give
other patch values.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.tiny_vlm_parts import _TOWER, vlm

IMG, START, END, BOS = 120, 110, 111, 0
QUERIES, PATCHES = 4, 16
NEW = 4
SPECIAL_IDS = list(range(100, 128))


@functools.cache
def tiny_kosmos2_5() -> Any:
    """Kosmos-2.5: a one-layer Pix2Struct-style tower (16 patches), 4 latent queries, a 2-layer text model."""
    return vlm(
        "Kosmos2_5",
        text_config={
            "vocab_size": 128,
            "embed_dim": 64,
            "layers": 2,
            "ffn_dim": 128,
            "attention_heads": 4,
            "max_position_embeddings": 512,
            "pad_token_id": 1,
            "bos_token_id": BOS,
            "eos_token_id": None,
        },
        vision_config={
            **_TOWER,
            "patch_embed_hidden_size": 12,
            "head_dim": 8,
            "num_hidden_layers": 1,
            "max_num_patches": PATCHES,
        },
        latent_query_num=QUERIES,
    )


def head() -> torch.Tensor:
    """What the processor puts before the text: BOS, image start, the image's placeholders, image end."""
    return torch.tensor([[BOS, START, *[IMG] * QUERIES, END]])


def patches(seed: int) -> torch.Tensor:
    """An image's flattened patches: row and column ids (1-4), then random values."""
    values = torch.rand(1, PATCHES, 12, generator=torch.Generator().manual_seed(seed)) * 2 - 1
    ids = torch.arange(PATCHES, dtype=torch.float32)
    return torch.cat([(ids // 4 + 1).view(1, -1, 1), (ids % 4 + 1).view(1, -1, 1), values], dim=-1)


def media_kwargs(ids: torch.Tensor, seed: int | None) -> dict[str, Any]:
    """What the processor hands `generate` for prompt `ids` with image `seed` (None: a text-only call)."""
    if seed is None:
        return {}
    mask = torch.zeros_like(ids)
    mask[0, 1], mask[0, 2 : QUERIES + 2], mask[0, QUERIES + 2] = -1, 1, -1
    size = torch.tensor([32.0])
    return {"flattened_patches": patches(seed), "image_embeds_position_mask": mask, "width": size, "height": size}


def _sweep() -> registry.SweepCase:
    """Kosmos-2.5 in the support matrix's scenario: one image per prompt, leading it (its item spans from BOS): no "c"."""
    seeds = {"a": registry.SEED_A, "b": registry.SEED_B}
    return registry.SweepCase(
        tiny_kosmos2_5(),
        dict.fromkeys(seeds, head()),
        lambda ids, names: media_kwargs(ids, seeds[names[0]]),
        head_len=0,
    )


registry.register_sweep("kosmos-2.5", _sweep)
