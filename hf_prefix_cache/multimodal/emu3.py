"""Emu3: images as VQ code grids embedded as text, one placeholder run per image counted from its size."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hf_prefix_cache.multimodal.base import KindItems, MediaAdapter, config_token_id, drop_cached_rows
from hf_prefix_cache.multimodal.media import MediaLayout
from hf_prefix_cache.multimodal.registry import MediaFamily, register


class Emu3Media(MediaAdapter):
    """Emu3: `pixel_values` `[images, C, H, W]` padded to the prompt's largest, `image_sizes` each valid ``h x w``.

    Its VQ-VAE encodes each row on its own into a code grid cropped to ``h / f x w / f`` (``f``:
    2 per level of `vq_config.channel_multiplier` past the first); each code row then gains an
    end-of-line code, and the codes are embedded by the text embeddings over one run of
    ``(h / f) * (w / f + 1)`` placeholders. The encoder's convolutions and attention read the
    padding next to the valid region, so an item is its whole padded row with its size: an
    image padded to a larger one later in a prompt keys (and encodes) differently.
    """

    handled = frozenset({"pixel_values", "image_sizes"})

    def _factor(self) -> int | None:
        """Pixels per code side, or None without a VQ config (a text-only build)."""
        levels = getattr(getattr(self.config, "vq_config", None), "channel_multiplier", None)
        return 2 ** (len(levels) - 1) if isinstance(levels, (list, tuple)) and levels else None

    def _items(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[KindItems]:
        token_id = config_token_id(self.config, "image_token_id")
        pixels, sizes = kwargs.get("pixel_values"), kwargs.get("image_sizes")
        if pixels is None and sizes is None:
            return [("image", token_id, [], [])]
        if pixels is not None and not isinstance(pixels, torch.Tensor):
            return [("image", token_id, [(pixels,)], None)]  # let hashing name its type
        factor = self._factor()
        if not isinstance(pixels, torch.Tensor) or not isinstance(sizes, torch.Tensor) or factor is None:
            return [("image", None, [], None)]
        if pixels.dim() != 4 or tuple(sizes.shape) != (pixels.shape[0], 2) or sizes.is_floating_point():
            return [("image", None, [], None)]
        counts = []
        for height, width in sizes.tolist():
            if not (factor <= height <= pixels.shape[-2] and factor <= width <= pixels.shape[-1]):
                return [("image", None, [], None)]
            counts.append((height // factor) * (width // factor + 1))
        return [("image", token_id, [(pixels[i], sizes[i]) for i in range(pixels.shape[0])], counts)]

    def _slice(self, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int) -> None:
        drop_cached_rows(kwargs, ("pixel_values", "image_sizes"), layout.num_cached("image", cached_len))


register(MediaFamily(("emu3",), Emu3Media))
