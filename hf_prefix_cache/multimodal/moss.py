"""MOSS Transcribe-Diarize: audio as Whisper windows, each window's placeholders possibly split by time-marker text."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hf_prefix_cache.multimodal.base import MediaAdapter, config_token_id, drop_cached_rows
from hf_prefix_cache.multimodal.media import MediaItem, MediaLayout, hash_media
from hf_prefix_cache.multimodal.registry import MediaFamily, register


class MossTranscribeDiarizeMedia(MediaAdapter):
    """MOSS Transcribe-Diarize: `input_features` `[windows, mels, frames]`, `input_features_mask` its valid frames.

    The processor cuts each clip into Whisper windows (one row each); the Whisper-style tower
    encodes every row on its own, and a row of ``n`` valid frames gives ``ceil(((n - 1) // 2 + 1)
    / audio_merge_size)`` placeholders (its frames after the stride-2 convolution, rounded up to
    whole merge groups). So an item is a window: its whole feature row and mask row (the tower
    reads the padding). The processor writes literal second counts (text) among a clip's
    placeholders every few seconds, so a window's placeholders may lie in several runs: its
    item spans from its first placeholder to its last, the text inside hashed with it.
    `padding_mask` (each clip's valid samples) reaches the model, which never reads it.
    """

    handled = frozenset({"input_features", "input_features_mask", "padding_mask"})

    def placeholder_ids(self) -> tuple[int | None, ...]:
        return (config_token_id(self.config, "audio_token_id"),)

    def _counts(self, kwargs: dict[str, Any]) -> list[int] | None:
        """Each row's placeholders, or None when the kwargs are not rows of features with their masks."""
        features, mask = kwargs.get("input_features"), kwargs.get("input_features_mask")
        merge = getattr(self.config, "audio_merge_size", None)
        if not isinstance(features, torch.Tensor) or not isinstance(mask, torch.Tensor) or not isinstance(merge, int):
            return None
        if features.dim() != 3 or tuple(mask.shape) != (features.shape[0], features.shape[-1]) or merge <= 0:
            return None
        if mask.is_floating_point() or mask.is_complex():
            return None
        counts = []
        for valid in mask.sum(-1).tolist():
            if valid <= 0:
                return None
            frames = (int(valid) - 1) // 2 + 1
            counts.append(-(-frames // merge))
        return counts

    def layout(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> MediaLayout | None:
        token_id = config_token_id(self.config, "audio_token_id")
        if token_id is None:
            return None
        positions = [i for i, t in enumerate(tokens) if t == token_id]
        features = kwargs.get("input_features")
        if features is None:
            return None if positions else MediaLayout(())
        if not isinstance(features, torch.Tensor):
            hash_media(features)  # raises UnhashableMediaError naming its type
            return None
        counts = self._counts(kwargs)
        if counts is None or sum(counts) != len(positions):
            return None
        mask = kwargs["input_features_mask"]
        items, offset = [], 0
        for i, count in enumerate(counts):
            start, end = positions[offset], positions[offset + count - 1] + 1
            span_ids = torch.tensor(list(tokens[start:end]), dtype=torch.long)
            items.append(MediaItem("audio", hash_media(features[i], mask[i], span_ids), start, end))
            offset += count
        return MediaLayout(tuple(items))

    def _slice(self, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int) -> None:
        drop_cached_rows(kwargs, ("input_features", "input_features_mask"), layout.num_cached("audio", cached_len))


register(MediaFamily(("moss_transcribe_diarize",), MossTranscribeDiarizeMedia))
