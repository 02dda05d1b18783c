"""LLaVA-NeXT (anyres patch stacks with `image_sizes`), LLaVA-NeXT-Video and Granite 4 Vision.

An image's placeholder count follows from its size: the base patch (one token per vision
patch) plus its anyres grid of patches unpadded back to the image's aspect ratio, with one
newline token per row. The adapter computes it with the model module's own functions, so
images with nothing between them (one placeholder run) are told apart.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from fractions import Fraction
from types import ModuleType
from typing import Any

import torch

from hf_prefix_cache.multimodal.base import KindItems, MediaAdapter, config_token_id, set_or_drop
from hf_prefix_cache.multimodal.media import MediaLayout, find_runs
from hf_prefix_cache.multimodal.registry import MediaFamily, register


class LlavaNextMedia(MediaAdapter):
    """LLaVA-NeXT: anyres patch stacks padded per prompt; an item is its valid patches plus its size.

    `pixel_values` is `[num_images, max_patches, C, H, W]` (the processor's padded stacks) or
    `[total_patches, C, H, W]` (the images' valid patches, concatenated).
    """

    handled = frozenset({"pixel_values", "image_sizes"})
    settings: tuple[str, ...] = ("vision_feature_layer", "vision_feature_select_strategy")
    #: The module whose functions the model itself uses to tile and unpad images.
    _modeling_name = "transformers.models.llava_next.modeling_llava_next"

    def _modeling(self) -> ModuleType:
        return importlib.import_module(self._modeling_name)

    def _num_patches(self, image_sizes: torch.Tensor, kwargs: dict[str, Any]) -> list[int]:
        """Patches of each image the vision tower encodes (base patch plus anyres grid)."""
        to_patches = self._modeling().image_size_to_num_patches
        return [
            to_patches(
                image_size=size,
                grid_pinpoints=self.config.image_grid_pinpoints,
                patch_size=self.config.vision_config.image_size,
            )
            for size in image_sizes
        ]

    def _num_tokens(self, tokens: Sequence[int], image_sizes: torch.Tensor, kwargs: dict[str, Any]) -> list[int] | None:
        """Placeholders of each image, as the model's feature packing produces them."""
        return [self._anyres_tokens(size) for size in image_sizes]

    def _anyres_tokens(self, size: torch.Tensor) -> int:
        modeling, vision = self._modeling(), self.config.vision_config
        side = self._tokens_per_side()
        rows, cols = modeling.get_anyres_image_grid_shape(size, self.config.image_grid_pinpoints, vision.image_size)
        # unpad_image only slices, so an empty channel dimension gives the unpadded feature-map shape.
        unpadded = modeling.unpad_image(torch.empty(0, rows * side, cols * side), size)
        height, width = int(unpadded.shape[1]), int(unpadded.shape[2])
        height, width = self._shrunk(height, width, side)
        return side * side + height * (width + 1)  # base patch + unpadded grid with a newline per row

    def _tokens_per_side(self) -> int:
        """Feature tokens along one side of a tile: one per vision patch (LLaVA-NeXT)."""
        vision = self.config.vision_config
        return int(vision.image_size // vision.patch_size)

    def _shrunk(self, height: int, width: int, side: int) -> tuple[int, int]:
        """The unpadded feature map's shape after any further resizing (none in LLaVA-NeXT)."""
        return height, width

    def _image_extra(self, kwargs: dict[str, Any], num_images: int) -> list[tuple[Any, ...]]:
        """Per image, further parts hashed with it (what else changes its states)."""
        return [()] * num_images

    def _items(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[KindItems]:
        token_id = config_token_id(self.config, "image_token_id", "image_token_index")
        pixels, sizes = kwargs.get("pixel_values"), kwargs.get("image_sizes")
        if pixels is None:
            return [("image", token_id, [], [])]
        if not isinstance(pixels, torch.Tensor) or not isinstance(sizes, torch.Tensor) or pixels.dim() not in (4, 5):
            return [("image", None, [], None)]
        if pixels.dim() == 5 and pixels.shape[0] != sizes.shape[0]:
            return [("image", None, [], None)]
        counts = self._num_patches(sizes, kwargs)
        lengths = self._num_tokens(tokens, sizes, kwargs)
        if lengths is None:
            return [("image", None, [], None)]
        extra = self._image_extra(kwargs, len(counts))
        if pixels.dim() == 5:
            parts = [(pixels[i, :n], sizes[i], *extra[i]) for i, n in enumerate(counts)]
        else:
            if sum(counts) != pixels.shape[0]:
                return [("image", None, [], None)]
            offsets = [0, *torch.tensor(counts).cumsum(0).tolist()]
            parts = [(pixels[offsets[i] : offsets[i + 1]], sizes[i], *extra[i]) for i in range(len(counts))]
        return [("image", token_id, parts, lengths)]

    def _slice(self, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int) -> None:
        pixels, sizes = kwargs.get("pixel_values"), kwargs.get("image_sizes")
        if pixels is None or sizes is None:
            return
        k = layout.num_cached("image", cached_len)
        keep = k < sizes.shape[0]
        # 4-D: the images' valid patches concatenated, so skip the cached images' patches.
        skip = sum(self._num_patches(sizes, kwargs)[:k]) if pixels.dim() == 4 else k
        set_or_drop(kwargs, "pixel_values", pixels[skip:], keep)
        set_or_drop(kwargs, "image_sizes", sizes[k:], keep)


def equal_split(tokens: Sequence[int], token_id: int | None, num: int) -> list[int] | None:
    """`num` equal placeholder counts summing to the prompt's `token_id` placeholders, or None."""
    if token_id is None or num == 0:
        return None
    total = sum(b - a for a, b in find_runs(tokens, token_id))
    return [total // num] * num if total % num == 0 else None


class LlavaNextVideoMedia(LlavaNextMedia):
    """LLaVA-NeXT-Video: LLaVA-NeXT images plus `pixel_values_videos` `[num_videos, frames, C, H, W]`.

    Videos of one call are stacked, so they all have one placeholder count.
    """

    handled = LlavaNextMedia.handled | {"pixel_values_videos"}
    _modeling_name = "transformers.models.llava_next_video.modeling_llava_next_video"

    def _items(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[KindItems]:
        token_id = config_token_id(self.config, "video_token_id", "video_token_index")
        videos = kwargs.get("pixel_values_videos")
        video: KindItems
        if videos is None:
            video = ("video", token_id, [], [])
        elif not isinstance(videos, torch.Tensor) or videos.dim() != 5:
            video = ("video", None, [], None)
        else:
            lengths = equal_split(tokens, token_id, videos.shape[0])
            parts: list[tuple[Any, ...]] = [(videos[i],) for i in range(videos.shape[0])]
            video = ("video", token_id if lengths is not None else None, parts, lengths)
        return [*super()._items(tokens, kwargs), video]

    def _slice(self, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int) -> None:
        super()._slice(kwargs, layout, cached_len)
        videos = kwargs.get("pixel_values_videos")
        if videos is not None:
            k = layout.num_cached("video", cached_len)
            set_or_drop(kwargs, "pixel_values_videos", videos[k:], k < videos.shape[0])


class Granite4VisionMedia(LlavaNextMedia):
    """Granite 4 Vision: LLaVA-NeXT's anyres tiles, each tile's patches downsampled by its Window Q-Former.

    Every projector (DeepStack and spatial) maps one tile's patch grid to `downsample_rate` of its side
    (windows within the tile), so an image's placeholders are LLaVA-NeXT's count on the downsampled
    grid; its features are added to the hidden states at its placeholders only, so a suffix's images
    bring their own.
    """

    _modeling_name = "transformers.models.granite4_vision.modeling_granite4_vision"

    def _tokens_per_side(self) -> int:
        return int(super()._tokens_per_side() * Fraction(self.config.downsample_rate))


def granite4_vision_media(model: Any) -> Granite4VisionMedia | None:
    """Granite 4 Vision's adapter; None (its media cold) without a `downsample_rate`, which its projectors need."""
    rate = getattr(model.config, "downsample_rate", None)
    return Granite4VisionMedia(model) if isinstance(rate, str) and rate else None


register(MediaFamily(("llava_next",), LlavaNextMedia))
register(MediaFamily(("llava_next_video",), LlavaNextVideoMedia))
register(MediaFamily(("granite4_vision",), granite4_vision_media))
