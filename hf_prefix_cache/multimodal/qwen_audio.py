"""Qwen2-Audio: one row of mel features per clip."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hf_prefix_cache.multimodal.base import KindItems, MediaAdapter, config_token_id, drop_cached_rows
from hf_prefix_cache.multimodal.media import MediaLayout
from hf_prefix_cache.multimodal.registry import MediaFamily, register


class Qwen2AudioMedia(MediaAdapter):
    """Qwen2-Audio: one row of `input_features` (fixed-length mel frames) and its frame mask per clip."""

    handled = frozenset({"input_features", "feature_attention_mask"})

    def _items(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[KindItems]:
        token_id = config_token_id(self.config, "audio_token_id", "audio_token_index")
        features, mask = kwargs.get("input_features"), kwargs.get("feature_attention_mask")
        if features is None:
            return [("audio", token_id, [], [])]
        if not isinstance(features, torch.Tensor) or not isinstance(mask, torch.Tensor) or features.dim() != 3:
            return [("audio", None, [], None)]
        # Placeholders per clip: the encoder's two stride-2 stages applied to its valid frame count.
        frames = (mask.sum(-1) - 1) // 2 + 1
        lengths = ((frames - 2) // 2 + 1).tolist()
        if any(n < 2 for n in lengths):
            # A one-token clip in the suffix would send transformers down its legacy expansion path.
            return [("audio", None, [], None)]
        return [("audio", token_id, [(features[i], mask[i]) for i in range(features.shape[0])], lengths)]

    def _slice(self, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int) -> None:
        drop_cached_rows(kwargs, ("input_features", "feature_attention_mask"), layout.num_cached("audio", cached_len))


register(MediaFamily(("qwen2_audio",), Qwen2AudioMedia))
