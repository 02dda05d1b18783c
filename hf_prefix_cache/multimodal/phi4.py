"""Phi-4-multimodal: HD-cropped images and audio clips, each its own placeholder run.

What the model consumes of each item (transformers 5.23 and 5.24 agree):

* an image is one row of `image_pixel_values` ``[images, max_crops, C, H, W]`` (padded to the
  prompt's most crops): its global crop and its ``(h / crop) * (w / crop)`` sub-crops, with
  `image_sizes` ``[images, 2]`` and, when given, the same crops of `image_attention_mask`;
  the crops past those (padding) are encoded but never read, so they are left out of the key;
* an audio clip is one row of `audio_input_features` (padded to the prompt's longest clip,
  hashed whole) with its `audio_embed_sizes` entry (its placeholder count) and its
  `audio_attention_mask` row. The conformer's output for a clip changes with its padding, so a
  clip re-padded by a longer one in a later prompt does not match; its key also holds the hash of
  its valid frames (`MediaItem.unpadded`), so the hook counts `media_padding` when the store holds
  that clip padded otherwise (or unpadded) where reuse stopped.

Features fill the placeholders in order, one run per image (the processor writes each image's
placeholders as one run); an image's count follows from its crops, so the layout requires one
run per image. Audio features go through one of two projections, chosen per call: the
"vision" one when the call passes any image, the "speech" one otherwise. So a clip's states
depend on whether its prompt holds an image: prompts with both are kept in their own scope,
and a resumed call whose suffix holds a clip but no image still passes an image (one of the
prompt's cached ones: with no image placeholder in the suffix the model encodes none of it)
so the clip gets the projection of its cold run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hf_prefix_cache.multimodal.base import (
    MediaAdapter,
    config_token_id,
    drop_cached_rows,
    merge_items,
    untensored_items,
)
from hf_prefix_cache.multimodal.media import MediaItem, MediaLayout, find_runs, hash_media
from hf_prefix_cache.multimodal.registry import MediaFamily, register

_IMAGE = ("image_pixel_values", "image_sizes", "image_attention_mask")
_AUDIO = ("audio_input_features", "audio_embed_sizes", "audio_attention_mask")


class Phi4MultimodalMedia(MediaAdapter):
    """Phi-4-multimodal: per-image crop stacks and per-clip mel rows, each item one placeholder run."""

    handled = frozenset((*_IMAGE, *_AUDIO))

    def placeholder_ids(self) -> tuple[int | None, ...]:
        return (self._token_id("vision_config"), self._token_id("audio_config"))

    def _token_id(self, sub: str) -> int | None:
        return config_token_id(
            getattr(self.config, sub, None), f"{'image' if sub == 'vision_config' else 'audio'}_token_id"
        )

    def layout(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> MediaLayout | None:
        images, clips = self._images(tokens, kwargs), self._clips(tokens, kwargs)
        if images is None or clips is None:
            return None
        return merge_items(images, clips)

    def _items(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[Any]:
        raise AssertionError("Phi4MultimodalMedia lays out its items in `layout`")

    def _kind_runs(self, tokens: Sequence[int], sub: str) -> list[tuple[int, int]]:
        """The placeholder runs of the kind whose tower's config is `sub`."""
        token_id = self._token_id(sub)
        return find_runs(tokens, token_id) if token_id is not None else []

    def _images(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[MediaItem] | None:
        runs = self._kind_runs(tokens, "vision_config")
        pixels, sizes, mask = (kwargs.get(name) for name in _IMAGE)
        if not isinstance(pixels, torch.Tensor):
            return untensored_items(runs, pixels, sizes, mask)
        crop = getattr(getattr(self.config, "vision_config", None), "crop_size", None)
        if not isinstance(sizes, torch.Tensor) or not isinstance(crop, int) or pixels.dim() != 5:
            return None
        if tuple(sizes.shape) != (pixels.shape[0], 2) or len(runs) != pixels.shape[0]:
            return None  # one run per image: the counts follow from the crops
        if mask is not None and (
            not isinstance(mask, torch.Tensor) or tuple(mask.shape[:2]) != tuple(pixels.shape[:2])
        ):
            return None
        items = []
        for i, ((height, width), (start, end)) in enumerate(zip(sizes.tolist(), runs, strict=True)):
            crops = 1 + (int(height) // crop) * (int(width) // crop)  # the global crop, then the sub-crops read
            if crops > pixels.shape[1] or height % crop or width % crop or height <= 0 or width <= 0:
                return None
            parts = (pixels[i, :crops], sizes[i], *((mask[i, :crops],) if mask is not None else ()))
            items.append(MediaItem("image", hash_media(*parts), start, end))
        return items

    def _clips(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[MediaItem] | None:
        runs = self._kind_runs(tokens, "audio_config")
        features, sizes, mask = (kwargs.get(name) for name in _AUDIO)
        if not isinstance(features, torch.Tensor):
            return untensored_items(runs, features, sizes, mask)
        if not isinstance(sizes, torch.Tensor) or features.dim() != 3 or tuple(sizes.shape) != (features.shape[0],):
            return None
        if mask is not None and (not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(features.shape[:2])):
            return None
        counts = [int(n) for n in sizes.tolist()]
        if len(runs) != len(counts) or any(b - a != n for (a, b), n in zip(runs, counts, strict=True)):
            return None
        items = []
        for i, (a, b) in enumerate(runs):
            digest = hash_media(features[i], sizes[i], *((mask[i],) if mask is not None else ()))
            items.append(MediaItem("audio", digest, a, b, _unpadded(features[i], sizes[i], mask, i)))
        return items

    def scope(self, items: Sequence[MediaItem]) -> list[str]:
        # A clip's projection depends on whether its prompt holds an image.
        kinds = {item.kind for item in items}
        return ["audio projected for vision"] if {"image", "audio"} <= kinds else []

    def _slice(self, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int) -> None:
        pixels = kwargs.get("image_pixel_values")
        num_images = pixels.shape[0] if isinstance(pixels, torch.Tensor) else 0
        k_images = layout.num_cached("image", cached_len)
        drop_cached_rows(kwargs, _AUDIO, layout.num_cached("audio", cached_len))
        if pixels is None:
            return
        clips_left = kwargs.get("audio_input_features") is not None
        # A suffix with clips but no image still needs an image for the clips' "vision" projection: keep the
        # last cached one (the suffix has no image placeholder, so the model encodes none of it).
        drop_cached_rows(kwargs, _IMAGE, min(k_images, num_images - 1) if clips_left else k_images)


def _unpadded(features: torch.Tensor, size: torch.Tensor, mask: Any, i: int) -> int | None:
    """A masked clip's digest as a prompt holding it alone keys it (its valid frames, no mask); None without a mask.

    The conformer reads a clip's padding (its output changes with it), so the padded key stays; this one
    only tells the hook which stored clip is this one padded otherwise (`reasons.MEDIA_PADDING`).
    """
    if mask is None:
        return None
    valid = mask[i].bool()
    frames = int(valid.sum())
    if not bool(valid[:frames].all()):
        return None  # not one leading run of frames
    return hash_media(features[:frames], size)


register(MediaFamily(("phi4_multimodal",), Phi4MultimodalMedia))
