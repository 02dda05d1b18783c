"""One family's media as the exactness and property tests build them: items, placeholders, kwargs."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.compare import assert_same_as_cold, generate
from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.tiny_processors import llava_next_processor
from hf_prefix_cache.testing.tiny_vlm_media import (
    audio_clip,
    audio_tokens,
    glm_marks,
    glm_video_tokens,
    llava_next_tokens,
    llava_pixels,
    paddle_pixels,
    pil_image,
    qwen_pixels,
    run,
)
from hf_prefix_cache.testing.tiny_vlm_parts import (
    AUDIO_ID,
    BOI_ID,
    EOI_ID,
    FAKE_IMAGE_ID,
    IMAGE_ID,
    VISION_END_ID,
    VISION_START_ID,
)
from hf_prefix_cache.testing.tiny_vlms import cached_vlm

NEW = 5
SPECIAL_IDS = list(range(100, 128))
IDEFICS = ("idefics3", "smolvlm", "idefics2")
ANYRES = ("llava_next", "llava_next_video")
GLM = ("glm4v", "glm4v_moe", "glm46v", "glmga", "glm_ocr")
# GLM-4V with videos as its media: the model cannot take images and videos in one prompt.
GLM_VIDEO = "glm4v/video"
GRIDS = [(1, 4, 6), (1, 2, 4), (1, 4, 4)]
#: Gemma 3's layout: ShieldGemma 2 generates with Gemma 3's class under its own model type.
GEMMA3 = ("gemma3", "shieldgemma2")


class Family:
    """Builds one family's images, their placeholders and the media kwargs of a prompt."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.model = cached_vlm(name.split("/")[0])

    def image(self, seed: int) -> Any:
        if self.name == "qwen2_audio":
            return audio_clip(seed, [60, 44, 80][seed % 3])
        if self.name in ("llava", *GEMMA3, *IDEFICS):
            return llava_pixels(seed)
        if self.name in ANYRES:
            sizes = [(30, 60), (50, 40), (32, 32), (64, 20)]
            return pil_image(seed, *sizes[seed % len(sizes)])
        if self.name == GLM_VIDEO:
            return qwen_pixels(seed, [(2, 4, 4), (2, 2, 4), (3, 2, 2)][seed % 3])
        if self.name == "paddleocr_vl":
            return paddle_pixels(seed, GRIDS[seed % 3])
        return qwen_pixels(seed, GRIDS[seed % 3])

    def placeholders(self, image: Any) -> torch.Tensor:
        if self.name == "qwen2_audio":
            return run(AUDIO_ID, audio_tokens(int(image[1].sum())))
        if self.name == "llava":
            return run(IMAGE_ID, 16)
        if self.name in GEMMA3:
            return torch.cat([run(BOI_ID, 1), run(IMAGE_ID, 4), run(EOI_ID, 1)], dim=1)
        if self.name in IDEFICS:
            return torch.cat([run(FAKE_IMAGE_ID, 1), run(IMAGE_ID, 4), run(FAKE_IMAGE_ID, 1)], dim=1)
        if self.name in ANYRES:
            kw = llava_next_processor()([image], return_tensors="pt")
            (n,) = llava_next_tokens(self.model, kw["pixel_values"], kw["image_sizes"])
            return run(IMAGE_ID, n)
        if self.name == GLM_VIDEO:
            return glm_video_tokens(image[1])
        n = int(image[1].prod()) // 4
        return torch.cat([run(VISION_START_ID, 1), run(IMAGE_ID, n), run(VISION_END_ID, 1)], dim=1)

    def kwargs(self, ids: torch.Tensor, images: list[Any]) -> dict[str, Any]:
        if self.name == "qwen2_audio":
            return {
                "input_features": torch.stack([f for f, _ in images]),
                "feature_attention_mask": torch.stack([m for _, m in images]),
            }
        if self.name == "llava":
            return {"pixel_values": torch.stack(images)}
        if self.name in GEMMA3:
            return {"pixel_values": torch.stack(images), "token_type_ids": (ids == IMAGE_ID).long()}
        if self.name in IDEFICS:
            return {"pixel_values": torch.stack(images)[None]}
        if self.name in ANYRES:
            return dict(llava_next_processor()(images, return_tensors="pt"))
        if self.name == GLM_VIDEO:
            return {
                "pixel_values_videos": torch.cat([rows for rows, _ in images]),
                "video_grid_thw": torch.cat([grid for _, grid in images]),
                "mm_token_type_ids": glm_marks(ids),
            }
        if self.name in GLM:
            return {
                "pixel_values": torch.cat([rows for rows, _ in images]),
                "image_grid_thw": torch.cat([grid for _, grid in images]),
                "mm_token_type_ids": glm_marks(ids),
            }
        return {
            "pixel_values": torch.cat([rows for rows, _ in images]),
            "image_grid_thw": torch.cat([grid for _, grid in images]),
            "mm_token_type_ids": (ids == IMAGE_ID).int(),
        }

    def check(self, ids: torch.Tensor, images: list[Any], store: PrefixCache) -> Any:
        # Answers never contain media or framing ids, so a later turn built from them stays a valid prompt.
        kwargs = {**self.kwargs(ids, images), "suppress_tokens": SPECIAL_IDS}
        return assert_same_as_cold(self.model, ids, store, new=NEW, **kwargs)

    def encoded(self, ids: torch.Tensor, images: list[Any], store: PrefixCache) -> int:
        """Run through `store` only; return how many images (or patch rows, for Qwen2-VL) the vision tower saw."""
        towers = {
            "qwen2_vl": "visual",
            "qwen2_5_vl": "visual",
            "qwen3_vl": "visual",
            "qwen2_audio": "audio_tower",
            "idefics3": "vision_model",
            "idefics2": "vision_model",
            "smolvlm": "vision_model",
        }
        tower = getattr(self.model.model, towers.get(self.name, "vision_tower"))
        seen: list[int] = []

        def record(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], _out: Any) -> None:
            first = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
            seen.append(int(first.shape[0]))

        handle = tower.register_forward_hook(record, with_kwargs=True)
        try:
            generate(self.model, ids, NEW, past_key_values=store, **self.kwargs(ids, images))
        finally:
            handle.remove()
        return sum(seen)


QWEN_VL = ("qwen2_vl", "qwen2_5_vl")
FAMILIES = ("llava", *ANYRES, *QWEN_VL, "qwen3_vl", *GEMMA3, *IDEFICS, "qwen2_audio")
# Placeholder spans are framed by a text id the cut may stop after (vision-start, begin-of-image).
FRAMED = (*QWEN_VL, "qwen3_vl", *GEMMA3, *IDEFICS, *GLM, "paddleocr_vl")  # a start id before the placeholders


def _sweep(name: str) -> registry.SweepCase:
    """A family of this table (hand-written adapters) in the support matrix's scenario."""
    fam = Family(name)
    media = registry.three(fam.image)
    tokens = {k: fam.placeholders(m) for k, m in media.items()}
    return registry.SweepCase(
        fam.model, tokens, lambda ids, names: fam.kwargs(ids, [media[n] for n in names]), int(name in FRAMED)
    )


def _paligemma() -> registry.SweepCase:
    """PaliGemma (prefix-LM): images lead the prompt, then BOS; only an identical prompt is reused."""
    seeds = {"a": registry.SEED_A, "b": registry.SEED_B}
    tokens = {k: registry.cat(run(IMAGE_ID, 16), run(1, 1)) for k in seeds}

    def kwargs(ids: Any, names: Sequence[str]) -> dict[str, Any]:
        pixels = torch.stack([llava_pixels(seeds[n]) for n in names])
        return {"pixel_values": pixels, "token_type_ids": torch.zeros_like(ids)}

    return registry.SweepCase(cached_vlm("paligemma"), tokens, kwargs, head_len=0)


def _omni() -> registry.SweepCase:
    """Qwen2.5-Omni thinker: medium A an audio clip (after an audio-start id), C an image."""
    from hf_prefix_cache.testing.media.qwen3_omni import omni_sweep
    from hf_prefix_cache.testing.tiny_qwen_media import cached_omni, omni_audio_tokens

    return omni_sweep(cached_omni(), omni_audio_tokens, 60)


for _name in (*FAMILIES, *GLM, "paddleocr_vl"):
    registry.register_sweep(_name, partial(_sweep, _name))
registry.register_sweep("paligemma", _paligemma)
registry.register_sweep("qwen2_5_omni_thinker", _omni)
