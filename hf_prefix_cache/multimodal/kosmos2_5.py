"""Kosmos-2.5: one image per prompt, always its head, its features placed by a per-position mask."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hf_prefix_cache.multimodal.base import MediaAdapter
from hf_prefix_cache.multimodal.media import MediaItem, MediaLayout, hash_media
from hf_prefix_cache.multimodal.registry import MediaFamily, register


class Kosmos2_5Media(MediaAdapter):
    """Kosmos-2.5: `flattened_patches` `[1, patches, values]`, `image_embeds_position_mask` over the prompt.

    Its processor starts every prompt with BOS, an image-start id, `latent_query_num` image
    ids and an image-end id, then the text; the mask is ``[0, -1, 1 x n, -1, 0, ...]``: the
    image features go where it holds 1, and every position where it is not 0 (start, image,
    end) gets the image segment embedding. Once the cache holds anything, the model's
    `prepare_inputs_for_generation` drops the image features and the mask, so a restored prefix
    must hold the whole image: the item spans from BOS to the image-end id (its ids and the
    mask's values hashed with the patches), and any other cut reuses nothing. A call whose
    mask is not that pattern (or that passes a mask without patches) runs cold. `width` and
    `height` (the image's original size) reach the model, which only returns them.
    """

    handled = frozenset({"flattened_patches", "image_embeds_position_mask", "width", "height"})

    def placeholder_ids(self) -> tuple[int | None, ...]:
        return ()

    def _head_len(self, mask: torch.Tensor, length: int) -> int | None:
        """BOS, start, image ids and end: how many positions the image's head covers, if `mask` is the processor's."""
        n = getattr(self.config, "latent_query_num", None)
        if not isinstance(n, int) or n <= 0 or tuple(mask.shape) != (1, length) or length < n + 3:
            return None
        if mask.is_floating_point() or mask.is_complex():
            return None
        expected = torch.zeros(length, dtype=torch.long)
        expected[1], expected[2 : n + 2], expected[n + 2] = -1, 1, -1
        return n + 3 if torch.equal(mask[0].detach().cpu().long(), expected) else None

    def layout(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> MediaLayout | None:
        patches, mask = kwargs.get("flattened_patches"), kwargs.get("image_embeds_position_mask")
        if patches is None:
            # Text only: with no mask (or an all-zero one) every position takes the text segment, cached or not.
            if mask is None or (isinstance(mask, torch.Tensor) and not bool(mask.ne(0).any())):
                return MediaLayout(())
            return None
        if not isinstance(patches, torch.Tensor):
            hash_media(patches)  # raises UnhashableMediaError naming its type
            return None
        if not isinstance(mask, torch.Tensor) or patches.dim() != 3 or patches.shape[0] != 1:
            return None
        head = self._head_len(mask, len(tokens))
        if head is None:
            return None
        span_ids = torch.tensor(list(tokens[:head]), dtype=torch.long)
        digest = hash_media(patches[0], span_ids, mask[0, :head].detach().cpu().long())
        return MediaLayout((MediaItem("image", digest, 0, head),))

    def _slice(self, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int) -> None:
        # A restore holds the whole image (its item starts at 0); the model drops the mask itself once the cache
        # holds anything, and must not encode the patches again.
        kwargs.pop("flattened_patches", None)


register(MediaFamily(("kosmos-2.5",), Kosmos2_5Media, kwargs=("flattened_patches", "image_embeds_position_mask")))
