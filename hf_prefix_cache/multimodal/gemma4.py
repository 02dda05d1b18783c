"""Gemma 4 (and Gemma 4 Unified): patch-row images, multi-frame videos and audio clips.

What the model consumes of each item (transformers 5.23 and 5.24 agree):

* an image is one row of `pixel_values` ``[images, max_patches, 3 * p * p]`` with its row of
  `image_position_ids` ``[images, max_patches, 2]`` (``(-1, -1)`` marks padding; the
  processor pads every row to the same `max_patches`); it has ``valid patches // k**2``
  placeholders (``k``: `vision_config.pooling_kernel_size`), framed by begin/end-of-image ids;
* a video is `num_frames_per_video[i]` consecutive rows of `pixel_values_videos` with their
  `video_position_ids`, each frame its own run of placeholders after its timestamp text; the
  item spans from its first frame's first placeholder to its last frame's last (the text
  between frames is hashed with it, so no cut falls between frames);
* an audio clip is one row of `input_features` with its `input_features_mask` row (padded
  to the prompt's longest clip; the row is hashed whole, padding included), with as many
  placeholders as the mask has valid frames after two stride-2 subsamplings.

Gemma 4 Unified has no towers: patches and audio frames are projected one by one, one
placeholder per valid patch and per valid audio frame; otherwise the same layout.

Each row is encoded on its own and its features fill its placeholders in order. Vision
placeholders (`mm_token_type_ids` 1 and 2) attend both ways within their run on sliding
layers, so every vision item must be whole runs of its own: a cut then never falls inside a
bidirectional block, and `mm_token_type_ids` go to `generate` whole (the model reads them by
position from the start of the prompt).
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
    set_or_drop,
    untensored_items,
)
from hf_prefix_cache.multimodal.media import MediaItem, MediaLayout, find_runs, hash_media
from hf_prefix_cache.multimodal.registry import MediaFamily, register

#: The processor's `mm_token_type_ids` codes.
_CODES = {"image": 1, "video": 2, "audio": 3}


class Gemma4Media(MediaAdapter):
    """Gemma 4: images and videos as rows of patches with positions, audio clips as mel rows with masks."""

    handled = frozenset(
        {
            "pixel_values",
            "image_position_ids",
            "pixel_values_videos",
            "video_position_ids",
            "num_frames_per_video",
            "input_features",
            "input_features_mask",
            "mm_token_type_ids",
        }
    )
    marks_kwarg: str | None = "mm_token_type_ids"
    marks = (
        (("image_token_id",), _CODES["image"]),
        (("video_token_id",), _CODES["video"]),
        (("audio_token_id",), _CODES["audio"]),
    )

    def placeholder_ids(self) -> tuple[int | None, ...]:
        return tuple(config_token_id(self.config, f"{kind}_token_id") for kind in _CODES)

    def layout(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> MediaLayout | None:
        groups = [
            self._vision_items(tokens, kwargs, "image", "pixel_values", "image_position_ids"),
            self._vision_items(tokens, kwargs, "video", "pixel_values_videos", "video_position_ids"),
            self._audio_items(tokens, kwargs),
        ]
        if any(group is None for group in groups):
            return None
        return merge_items(*(group for group in groups if group is not None))

    # ------------------------------------------------------------------ layout
    def _kind_runs(self, tokens: Sequence[int], kind: str) -> list[tuple[int, int]]:
        token_id = config_token_id(self.config, f"{kind}_token_id")
        return find_runs(tokens, token_id) if token_id is not None else []

    def _patches_per_placeholder(self) -> int | None:
        """Valid patches pooled into one placeholder: ``k**2``."""
        kernel = getattr(getattr(self.config, "vision_config", None), "pooling_kernel_size", None)
        return kernel**2 if isinstance(kernel, int) and kernel > 0 else None

    def _frame_counts(self, positions: torch.Tensor) -> list[int] | None:
        """Placeholders per row of `*_position_ids` `[rows, patches, 2]`: its valid patches, pooled."""
        pooled = self._patches_per_placeholder()
        if pooled is None or positions.dim() != 3 or positions.shape[-1] != 2:
            return None
        valid = (positions != -1).all(dim=-1).sum(dim=-1).tolist()
        if any(v % pooled or v == 0 for v in valid):
            return None
        return [v // pooled for v in valid]

    def _vision_items(
        self, tokens: Sequence[int], kwargs: dict[str, Any], kind: str, data_name: str, positions_name: str
    ) -> list[MediaItem] | None:
        """One item per image, or per video (its frames' runs), each frame exactly one placeholder run."""
        runs = self._kind_runs(tokens, kind)
        data, positions = kwargs.get(data_name), kwargs.get(positions_name)
        if not isinstance(data, torch.Tensor):
            return untensored_items(runs, data, positions)
        if not isinstance(positions, torch.Tensor):
            return None
        counts = self._frame_counts(positions)
        if counts is None or data.dim() != 3 or tuple(data.shape[:2]) != tuple(positions.shape[:2]):
            return None
        frames = [1] * len(counts)
        if kind == "video":
            per_video = kwargs.get("num_frames_per_video")
            if not isinstance(per_video, torch.Tensor) or per_video.dim() != 1 or int(per_video.sum()) != len(counts):
                return None
            frames = [int(f) for f in per_video.tolist()]
            if any(f <= 0 for f in frames):
                return None
        # Bidirectional blocks are runs: each frame must be exactly one whole run.
        if len(runs) != len(counts) or any(b - a != n for (a, b), n in zip(runs, counts, strict=True)):
            return None
        items, row = [], 0
        for num in frames:
            start, end = runs[row][0], runs[row + num - 1][1]
            span_ids = torch.tensor(list(tokens[start:end]), dtype=torch.long)
            digest = hash_media(data[row : row + num], positions[row : row + num], span_ids)
            items.append(MediaItem(kind, digest, start, end))
            row += num
        return items

    def _audio_items(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[MediaItem] | None:
        """One item per clip: its mel row and mask row, as many placeholders as two stride-2 subsamplings leave."""
        runs = self._kind_runs(tokens, "audio")
        features, mask = kwargs.get("input_features"), kwargs.get("input_features_mask")
        if not isinstance(features, torch.Tensor):
            return untensored_items(runs, features, mask)
        if not isinstance(mask, torch.Tensor):
            return None
        if mask.dim() != 2 or features.dim() != 3 or tuple(features.shape[:2]) != tuple(mask.shape):
            return None
        counts = [self._audio_count(row) for row in mask]
        if len(runs) != len(counts) or any(b - a != n for (a, b), n in zip(runs, counts, strict=True)):
            return None
        return [MediaItem("audio", hash_media(features[i], mask[i]), a, b) for i, (a, b) in enumerate(runs)]

    def _audio_count(self, mask: torch.Tensor) -> int:
        """The processor's count: the mask through two stride-2 convolutions (kernel 3, padding 1)."""
        for _ in range(2):
            mask = mask[::2][: (len(mask) + 2 - 3) // 2 + 1]
        return int(mask.sum())

    def _items(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[Any]:
        raise AssertionError("Gemma4Media lays out its items in `layout`")

    # ------------------------------------------------------------------- resume
    def _slice(self, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int) -> None:
        drop_cached_rows(kwargs, ("pixel_values", "image_position_ids"), layout.num_cached("image", cached_len))
        k = layout.num_cached("video", cached_len)
        per_video = kwargs.get("num_frames_per_video")
        if kwargs.get("pixel_values_videos") is not None and per_video is not None:
            keep = k < per_video.shape[0]
            skip = int(per_video[:k].sum())
            for name in ("pixel_values_videos", "video_position_ids"):
                if kwargs.get(name) is not None:
                    set_or_drop(kwargs, name, kwargs[name][skip:], keep)
            set_or_drop(kwargs, "num_frames_per_video", per_video[k:], keep)
        drop_cached_rows(kwargs, ("input_features", "input_features_mask"), layout.num_cached("audio", cached_len))


class Gemma4UnifiedMedia(Gemma4Media):
    """Gemma 4 Unified: no towers; one placeholder per valid patch and per valid audio frame."""

    def _patches_per_placeholder(self) -> int | None:
        return 1

    def _audio_count(self, mask: torch.Tensor) -> int:
        return int(mask.sum())


register(MediaFamily(("gemma4",), Gemma4Media))
register(MediaFamily(("gemma4_unified",), Gemma4UnifiedMedia))
