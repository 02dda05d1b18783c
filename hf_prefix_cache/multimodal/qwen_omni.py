"""Qwen2.5-Omni thinker: audio clips, images and videos, with explicit M-RoPE positions.

The thinker merges audio features with `masked_scatter` and no count check, so features and
placeholders that disagree are silently misassigned: every clip's placeholder count comes from
the audio encoder's own length formula and a prompt whose runs do not match the counts exactly
runs cold (`media_placeholders`). Its built-in position logic reuses the `rope_deltas` left on
the model whenever the cache is not empty, even with media in the suffix, so the positions of
the whole prompt are always passed (`get_rope_index` with every grid and clip length).

With `use_audio_in_video` every video is written as one block whose video and audio
placeholders alternate in time chunks; such a block is one item holding the video and its
clip (clips are consumed in placeholder order, standalone or inside a block).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hf_prefix_cache.multimodal.base import KindItems, Padded, config_token_id, drop_cached_rows, with_items
from hf_prefix_cache.multimodal.media import MediaItem, MediaLayout, hash_media
from hf_prefix_cache.multimodal.qwen_vl import Qwen2_5VLMedia
from hf_prefix_cache.multimodal.registry import MediaFamily, register


class Qwen2_5OmniThinkerMedia(Qwen2_5VLMedia):
    """Qwen2.5-Omni thinker: images and videos as Qwen2.5-VL, plus one audio item per `input_features` row.

    A clip is its valid mel frames (`feature_attention_mask` selects them; padding is not
    hashed). A video is also keyed by its `video_second_per_grid`, which spaces its positions.
    """

    handled = frozenset(
        {
            "pixel_values",
            "image_grid_thw",
            "pixel_values_videos",
            "video_grid_thw",
            "video_second_per_grid",
            "input_features",
            "feature_attention_mask",
            "use_audio_in_video",
        }
    )
    _SECONDS = "video_second_per_grid"
    #: Whether the positions of `get_rope_index` are cast to whole numbers, as the thinker's own path does.
    _whole_positions = True
    marks_kwarg = None  # the thinker finds its media by token id; it takes no `mm_token_type_ids`

    def _items(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[KindItems]:
        visual = super()._items(tokens, kwargs)
        if kwargs.get("use_audio_in_video"):
            # Videos and clips interleave; `layout` ties them to their placeholders itself.
            return [entry for entry in visual if entry[0] == "image"]
        return [*visual, self._audio(kwargs)]

    def _audio(self, kwargs: dict[str, Any]) -> KindItems:
        token_id = config_token_id(self.config, "audio_token_id")
        clips = self._clips(kwargs)
        if clips is None:
            return ("audio", None, [], None)
        parts, lengths = clips
        return ("audio", token_id, parts, lengths)

    def _clips(self, kwargs: dict[str, Any]) -> tuple[list[tuple[Any, ...]], list[int]] | None:
        """Each clip's hashed parts (its valid frames `[mel, frames]`) and placeholder count; None if unusable."""
        features, mask = kwargs.get("input_features"), kwargs.get("feature_attention_mask")
        if features is None and mask is None:
            return [], []
        if not isinstance(features, torch.Tensor) or not isinstance(mask, torch.Tensor):
            return None
        if features.dim() != 3 or mask.dim() != 2 or tuple(mask.shape) != (features.shape[0], features.shape[2]):
            return None
        lengths = self._clip_lens(mask)
        extra = self._clip_extra(mask)
        parts = [(features[i][:, mask[i].bool()], *extra) for i in range(features.shape[0])]
        return parts, [int(n) for n in lengths.tolist()]

    def _clip_lens(self, mask: torch.Tensor) -> torch.Tensor:
        """Each clip's placeholders, from its valid frames (`mask` `[clips, frames]`) by the audio tower's formula."""
        lengths: torch.Tensor = self.model.model.audio_tower._get_feat_extract_output_lengths(mask.sum(-1))[1]
        return lengths

    def _clip_extra(self, mask: torch.Tensor) -> tuple[Any, ...]:
        """What is hashed with every clip of a call besides its valid frames: nothing here."""
        return ()

    def layout(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> MediaLayout | None:
        if not kwargs.get("use_audio_in_video"):
            return super().layout(tokens, kwargs)
        images = super().layout(tokens, kwargs)
        return with_items(images, self._audio_video(tokens, kwargs))

    def _audio_video(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[MediaItem] | None:
        """Items of `use_audio_in_video` prompts: each video block (video + its clip) and each standalone clip.

        Walks the placeholders in order: a video placeholder opens a block that must hold exactly
        the next video's and the next clip's placeholders (in any interleaving) and nothing else;
        an audio placeholder outside a block starts the next clip's run. None on any mismatch.
        """
        audio_id = config_token_id(self.config, "audio_token_id")
        video_id = config_token_id(self.config, "video_token_id")
        clips = self._clips(kwargs)
        videos = self._videos_parts(kwargs)
        if audio_id is None or video_id is None or clips is None or videos is None:
            return None
        clip_parts, clip_lens = clips
        video_parts, video_lens = videos
        items: list[MediaItem] = []
        clip = video = 0
        pos, n = 0, len(tokens)
        while pos < n:
            token = tokens[pos]
            if token == video_id:
                if video == len(video_lens) or clip == len(clip_lens):
                    return None
                need = {video_id: video_lens[video], audio_id: clip_lens[clip]}
                end = pos
                while end < n and tokens[end] in need and need[tokens[end]] > 0:
                    need[tokens[end]] -= 1
                    end += 1
                if any(need.values()):
                    return None
                span_ids = torch.tensor(list(tokens[pos:end]), dtype=torch.long)
                digest = hash_media(*video_parts[video], *clip_parts[clip], span_ids)
                items.append(MediaItem("video", digest, pos, end))
                video, clip = video + 1, clip + 1
            elif token == audio_id:
                if clip == len(clip_lens):
                    return None
                end = pos + clip_lens[clip]
                if clip_lens[clip] <= 0 or end > n or any(t != audio_id for t in tokens[pos:end]):
                    return None
                items.append(MediaItem("audio", hash_media(*clip_parts[clip]), pos, end))
                clip += 1
            else:
                end = pos + 1
            pos = end
        if video != len(video_lens) or clip != len(clip_lens):
            return None
        return items

    def _videos_parts(self, kwargs: dict[str, Any]) -> tuple[list[tuple[Any, ...]], list[int]] | None:
        """Each video's hashed parts and placeholder count, as the base layout would take them."""
        (entry,) = [e for e in super()._items((), kwargs) if e[0] == "video"]
        _, token_id, parts, lengths = entry
        if token_id is None or lengths is None:
            return None
        return [p.parts if isinstance(p, Padded) else p for p in parts], lengths

    def _slice(self, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int) -> None:
        super()._slice(kwargs, layout, cached_len)
        k = layout.num_cached("audio", cached_len)
        if kwargs.get("use_audio_in_video"):
            k += layout.num_cached("video", cached_len)  # each video block holds one clip
        drop_cached_rows(kwargs, ("input_features", "feature_attention_mask"), k)

    def positions(self, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        """Explicit `[4, 1, L]` positions of the whole prompt from the thinker's own `get_rope_index`."""
        mask = kwargs.get("feature_attention_mask")
        rope, _ = self.model.get_rope_index(
            input_ids,
            image_grid_thw=kwargs.get("image_grid_thw"),
            video_grid_thw=kwargs.get("video_grid_thw"),
            attention_mask=torch.ones_like(input_ids),
            use_audio_in_video=bool(kwargs.get("use_audio_in_video")),
            audio_seqlens=mask.sum(-1) if mask is not None else None,
            second_per_grids=kwargs.get(self._SECONDS),
        )
        # As the thinker's `_prepare_position_ids_for_generation`: text positions joined to its rope rows.
        text = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        return torch.cat([text[None], rope.to(text.dtype) if self._whole_positions else rope], dim=0)


register(MediaFamily(("qwen2_5_omni_thinker",), Qwen2_5OmniThinkerMedia))
