"""LLaVA-NeXT (anyres patch stacks with `image_sizes`) and LLaVA-NeXT-Video."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..media import MediaLayout, find_runs
from .base import KindItems, MediaAdapter, config_token_id, set_or_drop


class LlavaNextMedia(MediaAdapter):
    """LLaVA-NeXT: anyres patch stacks padded per prompt; an item is its valid patches plus its size."""

    handled = frozenset({"pixel_values", "image_sizes"})

    def _num_patches(self, image_sizes: torch.Tensor) -> list[int]:
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        return [
            image_size_to_num_patches(
                image_size=size,
                grid_pinpoints=self.config.image_grid_pinpoints,
                patch_size=self.config.vision_config.image_size,
            )
            for size in image_sizes
        ]

    def _items(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[KindItems]:
        token_id = config_token_id(self.config, "image_token_id", "image_token_index")
        pixels, sizes = kwargs.get("pixel_values"), kwargs.get("image_sizes")
        if pixels is None:
            return [("image", token_id, [], None)]
        if not isinstance(pixels, torch.Tensor) or not isinstance(sizes, torch.Tensor) or pixels.dim() not in (4, 5):
            return [("image", None, [], None)]
        counts = self._num_patches(sizes)
        if pixels.dim() == 5:
            parts = [(pixels[i, :n], sizes[i]) for i, n in enumerate(counts)]
        else:
            offsets = [0, *torch.tensor(counts).cumsum(0).tolist()]
            parts = [(pixels[offsets[i] : offsets[i + 1]], sizes[i]) for i in range(len(counts))]
        return [("image", token_id, parts, None)]

    def _slice(self, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int) -> None:
        pixels, sizes = kwargs.get("pixel_values"), kwargs.get("image_sizes")
        if pixels is None or sizes is None:
            return
        k = layout.num_cached("image", cached_len)
        keep = k < sizes.shape[0]
        if pixels.dim() == 4:
            skip = sum(self._num_patches(sizes[:k]))
            pixels_left = pixels[skip:]
        else:
            pixels_left = pixels[k:]
        set_or_drop(kwargs, "pixel_values", pixels_left, keep)
        set_or_drop(kwargs, "image_sizes", sizes[k:], keep)


class LlavaNextVideoMedia(LlavaNextMedia):
    """LLaVA-NeXT-Video: LLaVA-NeXT images plus `pixel_values_videos` `[num_videos, frames, C, H, W]`.

    Videos of one call are stacked, so they all have one placeholder count.
    """

    handled = LlavaNextMedia.handled | {"pixel_values_videos"}

    def _items(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[KindItems]:
        token_id = config_token_id(self.config, "video_token_id", "video_token_index")
        videos = kwargs.get("pixel_values_videos")
        if videos is None:
            video: KindItems = ("video", token_id, [], [])
        elif not isinstance(videos, torch.Tensor) or videos.dim() != 5 or token_id is None:
            video = ("video", None, [], None)
        else:
            num = videos.shape[0]
            total = sum(b - a for a, b in find_runs(tokens, token_id))
            if num == 0 or total % num:
                video = ("video", None, [], None)
            else:
                video = ("video", token_id, [(videos[i],) for i in range(num)], [total // num] * num)
        return [*super()._items(tokens, kwargs), video]

    def _slice(self, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int) -> None:
        super()._slice(kwargs, layout, cached_len)
        videos = kwargs.get("pixel_values_videos")
        if videos is not None:
            k = layout.num_cached("video", cached_len)
            set_or_drop(kwargs, "pixel_values_videos", videos[k:], k < videos.shape[0])
