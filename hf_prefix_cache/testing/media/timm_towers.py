"""Tiny FastVLM and Perception LM (timm vision towers) and their media, for their media tests and the sweep.

Their towers are timm models, which need timm and torchvision: the builders import them only when
called, so the sweep builds these in its timm worker and `tests/media/test_media_timm_towers.py`
runs in a child interpreter with `.timm-packages` (`tests/media/test_gemma3n_env.py`).

* ``fast_vlm``: LLaVA with timm's FastViT-T8 (convolutions, stride 32): 4 placeholders (120) per
  64x64 image, no framing. Pool seeds 1 and 13 give one image each (other pixels).
* ``perception_lm``: a two-layer PE ViT per 32x32 tile (16x16 patches, its class token dropped): 4
  placeholders per tile, an image's tiles one run (120), a video's frames one run (121). Pool seeds
  1 and 13 give a one-tile image (other pixels), seed 2 a two-tile one; a video has two frames.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.tiny_vlm_parts import _MEDIA_IDS, text_config, vlm

IMG, VID = 120, 121
PER_TILE = 4  # placeholders per image, tile or frame in both families


@functools.cache
def tiny_fast_vlm() -> Any:
    """FastVLM: timm FastViT-T8 (inference mode, 768 channels out) on 64x64 images, Qwen2 text."""
    vision = {
        "architecture": "fastvit_t8",
        "do_pooling": False,
        "hidden_size": 768,
        "model_args": {"inference_mode": True},
    }
    return vlm("FastVlm", text_config=text_config("qwen2"), vision_config=vision, image_token_index=IMG)


@functools.cache
def tiny_perception_lm() -> Any:
    """Perception LM: a two-layer timm PE ViT (width 64) on 32x32 tiles, Llama text."""
    vision = {
        "architecture": "vit_pe_core_tiny_patch16_384",
        "model_args": {"embed_dim": 64, "depth": 2, "num_heads": 4, "img_size": 32},
    }
    return vlm("PerceptionLM", text_config=text_config("llama"), vision_config=vision, **_MEDIA_IDS)


@dataclass(frozen=True)
class Medium:
    """A medium of pool seed `seed`: `kind` "image" or "video"; its rows ``[count, 3, side, side]`` (tiles or frames)."""

    seed: int
    kind: str = "image"
    side: int = 32
    count: int = 1

    def rows(self) -> torch.Tensor:
        shape = (self.count, 3, self.side, self.side)
        return torch.rand(*shape, generator=torch.Generator().manual_seed(self.seed)) * 2 - 1


def fast_vlm_image(seed: int) -> Medium:
    return Medium(seed, side=64)


def fast_vlm_placeholders(image: Medium) -> torch.Tensor:
    return torch.full((1, PER_TILE), IMG, dtype=torch.long)


def fast_vlm_kwargs(images: list[Medium]) -> dict[str, Any]:
    """What the processor hands `generate`: one pixel_values row per image."""
    return {"pixel_values": torch.cat([i.rows() for i in images])} if images else {}


def perception_lm_image(seed: int) -> Medium:
    """Perception LM's image of pool seed `seed`: one tile, two for seed 2."""
    return Medium(seed, count=2 if seed % 3 == 2 else 1)


def perception_lm_video(seed: int) -> Medium:
    """Perception LM's video of pool seed `seed`: two frames."""
    return Medium(seed, "video", count=2)


def perception_lm_placeholders(medium: Medium) -> torch.Tensor:
    token = VID if medium.kind == "video" else IMG
    return torch.full((1, PER_TILE * medium.rows().shape[0]), token, dtype=torch.long)


def perception_lm_kwargs(media: list[Medium]) -> dict[str, Any]:
    """What the processor hands `generate`: a row of tiles per image, a row of frames per video (one tile or
    frame count per kind and call, as the processor stacks them)."""
    out: dict[str, Any] = {}
    for kind, name in (("image", "pixel_values"), ("video", "pixel_values_videos")):
        rows = [m.rows() for m in media if m.kind == kind]
        if rows:
            out[name] = torch.stack(rows)
    return out


def _fast_vlm_sweep() -> registry.SweepCase:
    """FastVLM in the support matrix's scenario: A, B and C one image each."""
    media = registry.three(fast_vlm_image)
    tokens = {k: fast_vlm_placeholders(m) for k, m in media.items()}
    return registry.SweepCase(tiny_fast_vlm(), tokens, lambda _ids, names: fast_vlm_kwargs([media[n] for n in names]))


def _perception_lm_sweep() -> registry.SweepCase:
    """Perception LM in the support matrix's scenario: A a one-tile image, C a two-frame video."""
    media = {**registry.three(perception_lm_image), "c": perception_lm_video(registry.SEED_C)}
    tokens = {k: perception_lm_placeholders(m) for k, m in media.items()}
    return registry.SweepCase(
        tiny_perception_lm(), tokens, lambda _ids, names: perception_lm_kwargs([media[n] for n in names])
    )


registry.register_sweep("fast_vlm", _fast_vlm_sweep)
registry.register_sweep("perception_lm", _perception_lm_sweep)
