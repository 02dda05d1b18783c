"""DeepSeek-OCR 2: each image is an item, its global view and its local crops together.

The processor hands a page as one global view (a row of `pixel_values`) and its local crops (the
next `num_local_patches[i]` rows of `pixel_values_local`, all crops of a call concatenated). The
tower encodes every view on its own: a SAM encoder, two stride-2 convolutions, then a causal
encoder over the view's patches and a fixed set of learned queries, whose outputs are the view's
features (144 queries for views of at most 144 patches, 256 above). An image's features are its
crops' queries, its global view's, and one learned separator, scattered over one placeholder run
in that order; so an image's placeholder count follows from its views' pixel sizes, and images
with nothing between them are told apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hf_prefix_cache.multimodal.base import KindItems, MediaAdapter, config_token_id, set_or_drop
from hf_prefix_cache.multimodal.generic_rules import config_path
from hf_prefix_cache.multimodal.media import MediaLayout
from hf_prefix_cache.multimodal.registry import MediaFamily, register

#: The tower's learned query tables: 144 queries (a 768-pixel view) up to this many patches, 256 above.
_SMALL_VIEW_PATCHES, _SMALL_QUERIES, _LARGE_QUERIES = 144, 144, 256


class DeepseekOcr2Media(MediaAdapter):
    """DeepSeek-OCR 2: `pixel_values` `[images, C, H, W]` (global views), `pixel_values_local`
    `[crops, C, h, w]` and `num_local_patches` (crops per image); an item is one image's views."""

    handled = frozenset({"pixel_values", "pixel_values_local", "num_local_patches"})

    def _queries(self, view: torch.Tensor) -> int | None:
        """Feature tokens of a view of `view`'s size: its query table's, by its patches after the convolutions."""
        patch = config_path(self.config, "vision_config.sam_config.patch_size")
        if not isinstance(patch, int) or patch <= 0:
            return None
        height, width = view.shape[-2] // patch, view.shape[-1] // patch
        for _ in range(2):  # two convolutions of kernel 3, stride 2, padding 1
            height, width = (height + 1) // 2, (width + 1) // 2
        if height * width == 0:
            return None
        return _SMALL_QUERIES if height * width <= _SMALL_VIEW_PATCHES else _LARGE_QUERIES

    def _items(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[KindItems]:
        token_id = config_token_id(self.config, "image_token_id")
        pixels, local = kwargs.get("pixel_values"), kwargs.get("pixel_values_local")
        if pixels is None:
            return [("image", token_id, [], [])]
        counts = _crop_counts(kwargs.get("num_local_patches"), pixels, local)
        if not isinstance(pixels, torch.Tensor) or pixels.dim() != 4 or counts is None or token_id is None:
            return [("image", None, [], None)]
        global_queries = self._queries(pixels)
        local_queries = self._queries(local) if isinstance(local, torch.Tensor) and local.shape[0] else 0
        if global_queries is None or local_queries is None:
            return [("image", None, [], None)]
        parts: list[tuple[Any, ...]] = []
        start = 0
        for i, n in enumerate(counts):
            crops = local[start : start + n] if n and isinstance(local, torch.Tensor) else torch.empty(0)
            parts.append((pixels[i], crops, torch.tensor([n])))
            start += n
        lengths = [n * local_queries + global_queries + 1 for n in counts]  # crops, global view, separator
        return [("image", token_id, parts, lengths)]

    def _slice(self, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int) -> None:
        pixels, local, given = (
            kwargs.get("pixel_values"),
            kwargs.get("pixel_values_local"),
            kwargs.get("num_local_patches"),
        )
        if pixels is None:
            return
        k = layout.num_cached("image", cached_len)
        keep = k < pixels.shape[0]
        counts = _crop_counts(given, pixels, local) or []
        set_or_drop(kwargs, "pixel_values", pixels[k:], keep)
        if given is not None:
            set_or_drop(kwargs, "num_local_patches", given[k:], keep)
        if local is not None:
            # The remaining images' crops; none left reads as no local views (the same features).
            rest = local[sum(counts[:k]) :]
            set_or_drop(kwargs, "pixel_values_local", rest, keep and rest.shape[0] > 0)


def _crop_counts(given: Any, pixels: Any, local: Any) -> list[int] | None:
    """Crops per image: `num_local_patches` as ints, checked against the crops given; None when they disagree."""
    if not isinstance(pixels, torch.Tensor) or pixels.dim() < 1:
        return None
    if given is None:
        return [0] * pixels.shape[0] if local is None else None
    counts = given.tolist() if isinstance(given, torch.Tensor) else list(given)
    if len(counts) != pixels.shape[0] or not all(isinstance(n, int) and n >= 0 for n in counts):
        return None
    total = local.shape[0] if isinstance(local, torch.Tensor) and local.dim() == 4 else None if local is not None else 0
    return counts if total == sum(counts) else None


register(MediaFamily(("deepseek_ocr2",), DeepseekOcr2Media, kwargs=("pixel_values_local", "num_local_patches")))
