"""HunYuan-VL: Qwen2-VL-style image rows, one placeholder run per image, and its own rotary axes.

Its vision tower embeds each image's patches with the positions of its own grid, attends within
each image (`cu_seqlens`) and merges each image on its own, adding begin, end and row-separator
features: an image of grid ``(1, h, w)`` is one run of ``(h/m) * (w/m + 1) + 2`` placeholders
(``m`` the spatial merge). Its `get_rope_index` gives one row per `mrope_section` entry (no text
row in front): text tokens keep their sequence index on every axis, an image's tokens take their
merged column, row and the image's ordinal on the last three. Its own path after a restored prefix
gives every suffix token its sequence index plus the `rope_deltas` left on the model by the last
request, on every axis (an image in the suffix would lose its grid positions), so the positions of
the whole prompt are always passed.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_prefix_cache.multimodal.qwen_vl import Qwen2VLMedia
from hf_prefix_cache.multimodal.registry import MediaFamily, register


class HunYuanVLMedia(Qwen2VLMedia):
    """HunYuan-VL: images as Qwen2-VL's rows, each one run with its row separators and ends; its own rotary axes."""

    handled = frozenset({"pixel_values", "image_grid_thw", "mm_token_type_ids"})
    marks = ((("image_token_id",), 1),)
    _KINDS = (("image", "image_token_id", "pixel_values", "image_grid_thw"),)

    def _item_len(self, kind: str, grid: list[int], merged: int) -> int | None:
        windows = self._merged_grid(grid)
        if windows is None or windows[0] != 1:
            return None  # the merger takes one frame of whole merge windows
        _, rows, cols = windows
        return rows * (cols + 1) + 2

    def positions(self, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        """Explicit `[axes, 1, L]` positions of the whole prompt, never reading `rope_deltas` left on the model."""
        grid = kwargs.get("image_grid_thw")
        if grid is None:
            axes = len(self.config.text_config.rope_parameters["mrope_section"])
            text = torch.arange(input_ids.shape[1], device=input_ids.device)
            return text.view(1, 1, -1).expand(axes, 1, -1)
        rope, _ = self.model.model.get_rope_index(
            input_ids,
            mm_token_type_ids=self.token_marks(input_ids),
            image_grid_thw=grid,
            attention_mask=torch.ones_like(input_ids),
        )
        return torch.as_tensor(rope)


register(MediaFamily(("hunyuan_vl",), HunYuanVLMedia))
