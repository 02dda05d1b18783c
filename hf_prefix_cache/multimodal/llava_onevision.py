"""LLaVA-OneVision: LLaVA-NeXT-style anyres images in two modes, and pooled videos.

What decides an image's placeholders and states (transformers 5.23,
`modeling_llava_onevision.py` and `processing_llava_onevision.py`):

* `batch_num_images` (one count per prompt of the batch; the processor sends `[1] * n` for a
  flat list of images and `[n]` for a nested one) sets each image's *mode*. An image of a
  prompt counted 1 is *tiled*: its base patch plus its anyres grid go through the tower, and
  the grid's feature map is unpadded to the image's aspect ratio, shrunk by bilinear
  interpolation when it exceeds `vision_aspect_ratio` ("anyres_max_N": more than 1.1 times
  N patches' worth), with a newline token per row. An image of a prompt counted more than 1 is
  *single-patch*: only the first patch of its stack (the processor pads the picture to a square
  and resizes it) goes through the tower, followed by one newline token. Without
  `batch_num_images` every image is tiled.
* So the same picture has other placeholders and other states depending on how many images
  share its prompt (nested processor input). Each item's hash includes its mode along with the
  pixels the tower consumes (base patch and grid when tiled, the first patch when single) and
  its `image_sizes` row; no state is reused across modes even where the counts happen to agree.
* Nothing else couples an image to its neighbours: each patch is encoded on its own and each
  image's features are packed on their own.
* The suffix keeps the call's `batch_num_images` unchanged: the model pairs the modes it
  derives with the remaining images by `zip`, which stops at the shorter list, so the
  remaining images keep their modes as long as all images of the prompt share one mode. A
  prompt mixing modes (`[1, 2]`, which the processor never produces for one prompt) runs cold
  as `media_mixed_patching`.
* `vision_aspect_ratio`, `vision_feature_layer` and `vision_feature_select_strategy` passed to
  `generate` reach the encoder (generate encodes media before prefill), so a call overriding
  the config's value runs cold (`vision_settings:<name>`).
* A video (`pixel_values_videos` `[num_videos, frames, C, H, W]`, stacked so all videos of a
  call have the same frame count) is one item: each frame's features pooled 2x2, then one
  newline token per video.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from hf_prefix_cache import reasons
from hf_prefix_cache.multimodal.base import config_token_id
from hf_prefix_cache.multimodal.llava_next import LlavaNextVideoMedia, equal_split
from hf_prefix_cache.multimodal.registry import MediaFamily, register


class LlavaOnevisionMedia(LlavaNextVideoMedia):
    """LLaVA-OneVision: images tiled or single-patch (set by `batch_num_images`), each video one item."""

    handled = LlavaNextVideoMedia.handled | {"batch_num_images"}
    settings = (*LlavaNextVideoMedia.settings, "vision_aspect_ratio")
    _modeling_name = "transformers.models.llava_onevision.modeling_llava_onevision"

    def why_cold(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> str | None:
        if len(set(self._tiled(kwargs, None))) > 1:
            return reasons.MEDIA_MIXED_PATCHING
        return super().why_cold(tokens, kwargs)

    def _tiled(self, kwargs: dict[str, Any], num_images: int | None) -> list[bool]:
        """Per image, whether it is tiled (its prompt has one image) or single-patch, as the model derives it."""
        counts = kwargs.get("batch_num_images")
        if counts is None:
            return [True] * (num_images or 0)
        return [int(n) == 1 for n in counts for _ in range(int(n))]

    def _num_patches(self, image_sizes: torch.Tensor, kwargs: dict[str, Any]) -> list[int]:
        tiled = super()._num_patches(image_sizes, kwargs)
        return [n if t else 1 for n, t in zip(tiled, self._tiled(kwargs, len(image_sizes)), strict=False)]

    def _num_tokens(self, tokens: Sequence[int], image_sizes: torch.Tensor, kwargs: dict[str, Any]) -> list[int] | None:
        modes = self._tiled(kwargs, len(image_sizes))
        if len(modes) != len(image_sizes):
            return None  # `batch_num_images` does not count these images
        if all(modes):
            return super()._num_tokens(tokens, image_sizes, kwargs)
        # Single-patch images: the tower's tokens for one patch plus a newline, equal for all of them.
        return equal_split(tokens, config_token_id(self.config, "image_token_id", "image_token_index"), len(modes))

    def _shrunk(self, height: int, width: int, side: int) -> tuple[int, int]:
        # As `pack_image_features`: shrink when the map exceeds `anyres_max_N` patches by more than 1.1x.
        max_patches = int(self.config.vision_aspect_ratio.strip("anyres_max_"))  # noqa: B005 (the model's own parsing)
        ratio = math.sqrt(height * width / (max_patches * side**2))
        if ratio > 1.1:
            return int(height // ratio), int(width // ratio)
        return height, width

    def _image_extra(self, kwargs: dict[str, Any], num_images: int) -> list[tuple[Any, ...]]:
        # The mode, explicitly: the same picture is encoded differently tiled and single-patch.
        return [(torch.tensor([int(tiled)], dtype=torch.int8),) for tiled in self._tiled(kwargs, num_images)]


register(MediaFamily(("llava_onevision",), LlavaOnevisionMedia))
