"""Cross-attention layers (Mllama): keys and values of the prompt's media, not of its tokens.

transformers keeps them in an ordinary `DynamicLayer`, filled once from the vision states of
the images passed to the first forward (`update` concatenates, so images passed on top of
restored ones are appended). Their length is the number of vision tokens, whatever the text
length, so the token-indexed store must not slice them: this adapter declares neither keys nor
states, and the working cache captures and restores them per media item (`capture_media`,
`restore_media`), one block of vision tokens per image.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_prefix_cache.model.layers.base import NoCacheAdapter


class CrossAttentionAdapter(NoCacheAdapter):
    """Holds nothing per token (so the store never slices it); media blocks go through the methods below."""

    holds_items = True  # `capture_media`, `restore_media`
    is_croppable = False  # its keys are the media's vision tokens: a crop by text length would cut them

    def capture_media(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys and values `[B, H, num_vision_tokens, D]` of every media item seen, or None when empty."""
        if not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
            return None
        return layer.keys, layer.values

    def restore_media(self, layer: Any, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Make a fresh `layer` hold the vision keys/values `[B, H, N, D]` of the restored items."""
        layer.dtype, layer.device = keys.dtype, keys.device
        layer.keys, layer.values = keys, values
        layer.is_initialized = True
