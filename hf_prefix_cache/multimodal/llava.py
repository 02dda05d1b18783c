"""LLaVA-style families: one `pixel_values` row per image (LLaVA, Gemma 3, PaliGemma)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hf_prefix_cache.multimodal.base import KindItems, MediaAdapter, config_token_id, set_or_drop
from hf_prefix_cache.multimodal.media import MediaLayout, find_runs
from hf_prefix_cache.multimodal.registry import MediaFamily, register


class LlavaMedia(MediaAdapter):
    """LLaVA: `pixel_values` `[num_images, C, H, W]`, every image the same number of placeholders."""

    handled = frozenset({"pixel_values"})
    settings: tuple[str, ...] = ("vision_feature_layer", "vision_feature_select_strategy")

    def _items(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[KindItems]:
        token_id = config_token_id(self.config, "image_token_id", "image_token_index")
        pixels = kwargs.get("pixel_values")
        if pixels is None:
            return [("image", token_id, [], [])]
        if not isinstance(pixels, torch.Tensor):
            return [("image", token_id, [(pixels,)], None)]  # let hashing name its type
        # All images have one placeholder count, so adjacent images in one run can be told apart.
        num = pixels.shape[0]
        total = sum(b - a for a, b in find_runs(tokens, token_id)) if token_id is not None else 0
        if num == 0 or total % num:
            return [("image", None, [], None)]
        return [("image", token_id, [(pixels[i],) for i in range(num)], [total // num] * num)]

    def _slice(self, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int) -> None:
        pixels = kwargs.get("pixel_values")
        if pixels is None:
            return
        k = layout.num_cached("image", cached_len)
        set_or_drop(kwargs, "pixel_values", pixels[k:], k < pixels.shape[0])


class Gemma3Media(LlavaMedia):
    """Gemma 3: LLaVA-like pixels; image blocks attend both ways, so `token_type_ids` go through whole.

    A cut never falls inside a placeholder span, so a cached block was always computed whole.
    """

    handled = frozenset({"pixel_values", "token_type_ids"})
    # Without the processor's marks an image block attends causally, not both ways.
    marks_kwarg: str | None = "token_type_ids"
    marks = ((("image_token_id", "image_token_index"), 1),)


class PaliGemmaMedia(LlavaMedia):
    """PaliGemma: the prompt is one bidirectional prefix, so only an identical prompt is reused."""

    handled = frozenset({"pixel_values", "token_type_ids"})
    whole_prompt_only = True

    def prompt_parts(self, kwargs: dict[str, Any]) -> list[Any]:
        # Which positions are prefix (0) or suffix (1) changes the mask; no marks is another mask again.
        marks = kwargs.get("token_type_ids")
        return [marks.tolist() if isinstance(marks, torch.Tensor) else marks]


register(MediaFamily(("llava",), LlavaMedia))
# ShieldGemma 2 generates with Gemma 3's class under its own config (its classifier wraps that model).
register(MediaFamily(("gemma3", "shieldgemma2"), Gemma3Media))
register(MediaFamily(("paligemma",), PaliGemmaMedia))
