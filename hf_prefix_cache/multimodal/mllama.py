"""Mllama (Llama 3.2 Vision): images reach the text through cross-attention layers.

Each `<|image|>` token stands for one image, which the model consumes as
`pixel_values[0, i]` `[max_num_tiles, C, H, W]` (tiles zero-padded to the processor's maximum)
with `aspect_ratio_ids[0, i]` and `aspect_ratio_mask[0, i]`; the item hashes all three. The
cross-attention layers hold the vision keys/values of every image of the prompt, one block of
`max_num_tiles * patches` per image whatever the text length; the store keeps each block with
the node of the image's placeholder (`item_layers`, item states) and restores it with the
prefix, so a resume passes only the suffix's images, and none (no vision forward) when all are
cached. `cross_attention_mask` always goes through whole.

Two facts of transformers 5.23 decide what may be shared:

- Text rows whose mask row is all zero (every token before the first image) are not masked
  out of cross-attention: they attend uniformly to every vision token of the prompt (only the
  MLP output is zeroed). So every position depends on every image of the prompt, and entries
  are shared only between prompts with the same images in the same order (`scope`). Adding an
  image to a conversation reuses nothing; that is counted as `cross_attention_new_image`.
- The states of a token depend on its mask row. The processor's mask rows are fixed by the
  image token positions before the row and each image's tile count, i.e. by the key; a prompt
  with any other mask (or none) runs cold as `cross_attention_mask`.

Knows nothing about the store or the tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hf_prefix_cache import reasons
from hf_prefix_cache.multimodal.base import KindItems, MediaAdapter, config_token_id, drop_cached_rows
from hf_prefix_cache.multimodal.media import MediaItem, MediaLayout
from hf_prefix_cache.multimodal.registry import MediaFamily, register

_PER_IMAGE = ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask")


class MllamaMedia(MediaAdapter):
    """Mllama: `pixel_values` `[1, num_images, max_num_tiles, C, H, W]`, one `<|image|>` token per image."""

    handled = frozenset({*_PER_IMAGE, "cross_attention_mask"})
    new_item_reason = reasons.CROSS_ATTENTION_NEW_IMAGE

    def _items(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[KindItems]:
        token_id = config_token_id(self.config, "image_token_id", "image_token_index")
        pixels, ratio_ids, ratio_mask = (kwargs.get(name) for name in _PER_IMAGE)
        if pixels is None:
            return [("image", token_id, [], [])]
        if (
            not isinstance(pixels, torch.Tensor)
            or not isinstance(ratio_ids, torch.Tensor)
            or not isinstance(ratio_mask, torch.Tensor)
            or pixels.dim() != 6
            or pixels.shape[0] != 1
            or ratio_ids.shape != pixels.shape[:2]
            or ratio_mask.shape != pixels.shape[:3]
        ):
            return [("image", None, [], None)]
        num = pixels.shape[1]
        parts = [(pixels[0, i], ratio_ids[0, i], ratio_mask[0, i]) for i in range(num)]
        return [("image", token_id, parts, [1] * num)]

    def _slice(self, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int) -> None:
        drop_cached_rows(kwargs, _PER_IMAGE, layout.num_cached("image", cached_len), axis=1)

    def why_cold(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> str | None:
        reason = super().why_cold(tokens, kwargs)
        if reason is not None:
            return reason
        ratio_mask = kwargs.get("aspect_ratio_mask")
        if kwargs.get("pixel_values") is None or not isinstance(ratio_mask, torch.Tensor):
            return None  # text only: the cross-attention layers are skipped, the mask is unused
        mask = kwargs.get("cross_attention_mask")
        expected = self.processor_mask(tokens, [int(n) for n in ratio_mask[0].sum(-1).tolist()], ratio_mask.shape[-1])
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(expected.shape):
            return reasons.CROSS_ATTENTION_MASK
        return None if torch.equal(mask.detach().cpu() != 0, expected) else reasons.CROSS_ATTENTION_MASK

    def processor_mask(self, tokens: Sequence[int], num_tiles: list[int], max_num_tiles: int) -> torch.Tensor:
        """The processor's cross-attention mask `[1, L, num_images, max_num_tiles]` (bool) for `tokens`."""
        from transformers.models.mllama.processing_mllama import (
            convert_sparse_cross_attention_mask_to_dense,
            get_cross_attention_token_mask,
        )

        token_id = config_token_id(self.config, "image_token_id", "image_token_index")
        assert token_id is not None, "a prompt with images has an image token id"
        spans = get_cross_attention_token_mask(list(tokens), token_id)
        dense = convert_sparse_cross_attention_mask_to_dense([spans], [num_tiles], max_num_tiles, len(tokens))
        return torch.from_numpy(dense) != 0

    def scope(self, items: Sequence[MediaItem]) -> list[str]:
        return [f"{item.kind}:{item.digest:032x}" for item in items]

    def item_layers(self) -> tuple[int, ...]:
        return tuple(self.config.get_text_config(decoder=True).cross_attention_layers)


register(MediaFamily(("mllama",), MllamaMedia))
