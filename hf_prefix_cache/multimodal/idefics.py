"""Idefics3, SmolVLM, Idefics2 and GraniteDocling: each image crop (tile) is an item.

Idefics2 takes the same inputs; a perceiver resampler (its latents attend to one crop's
patches only) replaces the pixel shuffle, so each crop still has a fixed number of placeholders.

Idefics2's processor pads every image of a prompt to the prompt's largest (zeros, with
`pixel_attention_mask` marking the valid region), so a later, larger image changes an earlier
image's tensor. Its output does not depend on that padding: the patches wholly in the padding are
masked out of the vision encoder's and the resampler's attention, and the valid patches' positions
follow from the valid patch counts alone. So where the valid region is a top-left rectangle of whole
patches, a crop is keyed by that region only, and matches the same image padded otherwise or not at
all. A region that ends inside a patch makes that patch part padding, so there the whole padded
crop and its mask stay the key. Idefics3 and SmolVLM keep the whole crop too: their pixel shuffle
reads every patch, padding included (their processor gives every crop one size, so none is padded).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hf_prefix_cache.multimodal.base import KindItems, MediaAdapter, config_token_id, hashed_parts, set_or_drop
from hf_prefix_cache.multimodal.media import MediaLayout, find_runs
from hf_prefix_cache.multimodal.registry import MediaFamily, register


class Idefics3Media(MediaAdapter):
    """Idefics3 / SmolVLM / Idefics2: `pixel_values` `[1, num_crops, C, H, W]`; each crop is an item.

    The processor splits an image into crops, each with its own placeholder run, and the
    vision model encodes crops one by one, so a cached prefix may end between two crops.
    """

    handled = frozenset({"pixel_values", "pixel_attention_mask"})

    def _items(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[KindItems]:
        token_id = config_token_id(self.config, "image_token_id")
        pixels, mask = kwargs.get("pixel_values"), kwargs.get("pixel_attention_mask")
        if pixels is None:
            return [("image", token_id, [], [])]
        if not isinstance(pixels, torch.Tensor) or pixels.dim() != 5 or pixels.shape[0] != 1 or token_id is None:
            return [("image", None, [], None)]
        num = pixels.shape[1]
        total = sum(b - a for a, b in find_runs(tokens, token_id))
        # All-zero crops are batch padding, which the model drops: they have no placeholders.
        if num == 0 or total % num or bool((pixels == 0).flatten(2).all(-1).any()):
            return [("image", None, [], None)]
        if getattr(self.config, "model_type", None) == "idefics2":
            patch = getattr(getattr(self.config, "vision_config", None), "patch_size", None)
            parts = [_valid_region(pixels[0, i], mask[0, i] if mask is not None else None, patch) for i in range(num)]
        else:
            parts = [(pixels[0, i], *((mask[0, i],) if mask is not None else ())) for i in range(num)]
        return [("image", token_id, parts, [total // num] * num)]

    def _slice(self, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int) -> None:
        pixels, mask = kwargs.get("pixel_values"), kwargs.get("pixel_attention_mask")
        if pixels is None:
            return
        k = layout.num_cached("image", cached_len)
        keep = k < pixels.shape[1]
        set_or_drop(kwargs, "pixel_values", pixels[:, k:], keep)
        if mask is not None:
            set_or_drop(kwargs, "pixel_attention_mask", mask[:, k:], keep)


def _valid_region(crop: torch.Tensor, mask: Any, patch: Any) -> tuple[torch.Tensor, ...]:
    """What an Idefics2 crop's key covers: its valid top-left rectangle of whole patches, else the crop and mask."""
    if mask is None:
        return (crop,)
    whole = (crop, mask)
    if not isinstance(mask, torch.Tensor) or mask.shape != crop.shape[-2:] or not isinstance(patch, int):
        return whole
    valid = mask.bool()
    height, width = int(valid.any(-1).sum()), int(valid.any(-2).sum())
    if height % patch or width % patch or int(valid.sum()) != height * width or not bool(valid[:height, :width].all()):
        return whole  # not a rectangle of whole patches from the top-left corner: padding reaches some patch
    return (crop[..., :height, :width],)


class GraniteDoclingMedia(Idefics3Media):
    """GraniteDocling: Idefics3's tiles, `pixel_attention_mask` one flag per tile (`[1, num_tiles]`).

    Each tile is encoded on its own (its patches, pixel shuffle, a fixed 2D position table), and its
    DeepStack features are added to the hidden states at its placeholders only, so a suffix's tiles
    bring their own. `tile_fine_mask` (the processor's ``fine_route=True``) sends every tile of the call
    through the connector's fine path (four times the placeholders, other features) whatever its
    value: its presence is hashed with each tile, and it is passed on while tiles remain. The density
    router only scores pages (`predict_fine_route`); it changes no feature.
    """

    handled = Idefics3Media.handled | {"tile_fine_mask"}

    def _items(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[KindItems]:
        mask = kwargs.get("pixel_attention_mask")
        if kwargs.get("pixel_values") is not None and isinstance(mask, torch.Tensor) and not bool(mask.all()):
            return [("image", None, [], None)]  # padding tiles of a batch: the model drops them
        ((kind, token_id, parts, lengths),) = super()._items(tokens, kwargs)
        route = torch.tensor([kwargs.get("tile_fine_mask") is not None])  # the fine path, if given at all
        return [(kind, token_id, [(*hashed_parts(part), route) for part in parts], lengths)]

    def _slice(self, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int) -> None:
        super()._slice(kwargs, layout, cached_len)
        if kwargs.get("pixel_values") is None:
            kwargs.pop("tile_fine_mask", None)  # every tile cached: nothing is encoded


register(MediaFamily(("idefics3", "smolvlm", "idefics2"), Idefics3Media))
register(MediaFamily(("granite_docling",), GraniteDoclingMedia, kwargs=("tile_fine_mask",)))
