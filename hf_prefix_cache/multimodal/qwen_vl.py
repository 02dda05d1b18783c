"""The Qwen-VL family: flattened patch rows per item and explicit M-RoPE positions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hf_prefix_cache.multimodal.base import KindItems, MediaAdapter, config_token_id, set_or_drop, with_items
from hf_prefix_cache.multimodal.media import MediaItem, MediaLayout, assign_spans, hash_media
from hf_prefix_cache.multimodal.registry import MediaFamily, register


class Qwen2VLMedia(MediaAdapter):
    """Qwen2-VL: flattened patch rows per item from `*_grid_thw`; M-RoPE positions over the whole prompt."""

    handled = frozenset(
        {"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "mm_token_type_ids"}
    )
    has_positions = True
    # Without the processor's marks transformers gives every position a text position (no M-RoPE).
    marks_kwarg: str | None = "mm_token_type_ids"
    marks: tuple[tuple[tuple[str, ...], int], ...] = ((("image_token_id",), 1), (("video_token_id",), 2))
    #: The kwarg holding each video's seconds per temporal grid step (it spaces the video's positions).
    _SECONDS = "second_per_grid_ts"
    #: Per media kind: its name, the config name of its placeholder id, its pixels kwarg and its grid kwarg.
    _KINDS: tuple[tuple[str, str, str, str], ...] = (
        ("image", "image_token_id", "pixel_values", "image_grid_thw"),
        ("video", "video_token_id", "pixel_values_videos", "video_grid_thw"),
    )

    def _merge(self) -> int:
        return int(self.config.vision_config.spatial_merge_size) ** 2

    def _items(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[KindItems]:
        out: list[KindItems] = []
        for kind, id_name, pixels_name, grid_name in self._KINDS:
            token_id = config_token_id(self.config, id_name)
            pixels, grid = kwargs.get(pixels_name), kwargs.get(grid_name)
            if pixels is None and grid is None:
                out.append((kind, token_id, [], []))
                continue
            if not isinstance(pixels, torch.Tensor) or not isinstance(grid, torch.Tensor):
                out.append((kind, None, [], None))
                continue
            rows = grid.prod(-1).tolist()
            if sum(rows) != pixels.shape[0]:
                out.append((kind, None, [], None))
                continue
            counts = [self._item_len(kind, row, n // self._merge()) for row, n in zip(grid.tolist(), rows, strict=True)]
            if None in counts:
                out.append((kind, None, [], None))
                continue
            offsets = [0, *torch.tensor(rows).cumsum(0).tolist()]
            parts = [
                (pixels[offsets[i] : offsets[i + 1]], grid[i], *self._extra(kind, kwargs, i)) for i in range(len(rows))
            ]
            out.append((kind, token_id, parts, [n for n in counts if n is not None]))
        return out

    def _item_len(self, kind: str, grid: list[int], merged: int) -> int | None:
        """An item's placeholders from its `(t, h, w)` grid row: Qwen2-VL's, `merged`, its patches per merge area.

        None where the family's tower cannot take the item (the call then runs cold).
        """
        return merged

    def _merged_grid(self, grid: list[int]) -> tuple[int, int, int] | None:
        """A `(t, h, w)` grid row in merge windows, ``(t, h / m, w / m)``; None unless its sides are whole windows."""
        t, h, w = grid
        merge = int(self.config.vision_config.spatial_merge_size)
        if h % merge or w % merge:
            return None
        return t, h // merge, w // merge

    def _extra(self, kind: str, kwargs: dict[str, Any], index: int) -> tuple[Any, ...]:
        """Further per-item inputs that change the item's states (hashed with it)."""
        return ()

    def _rope_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """Further `get_rope_index` arguments, for all items."""
        return {}

    def _slice(self, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int) -> None:
        for kind, _, pixels_name, grid_name in self._KINDS:
            pixels, grid = kwargs.get(pixels_name), kwargs.get(grid_name)
            if pixels is None or grid is None:
                continue
            k = layout.num_cached(kind, cached_len)
            keep = k < grid.shape[0]
            skip = int(grid[:k].prod(-1).sum()) if k else 0
            set_or_drop(kwargs, pixels_name, pixels[skip:], keep)
            set_or_drop(kwargs, grid_name, grid[k:], keep)
            if kind == "video" and kwargs.get(self._SECONDS) is not None:
                set_or_drop(kwargs, self._SECONDS, kwargs[self._SECONDS][k:], keep)

    def resume_kwargs(
        self, input_ids: torch.Tensor, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int
    ) -> dict[str, Any]:
        # Positions come from all grids, so compute them before slicing: [4, 1, L] = text row + 3 M-RoPE rows.
        positions = self.positions(input_ids, kwargs)
        out = super().resume_kwargs(input_ids, kwargs, layout, cached_len)
        out["position_ids"] = positions
        return out

    def prefill_positions(self, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor | None:
        return self.positions(input_ids, kwargs)

    def suffix_embeds(
        self, input_ids: torch.Tensor, kwargs: dict[str, Any], layout: MediaLayout, start: int
    ) -> torch.Tensor:
        assert self.embeds_suffix, "only families declaring `embeds_suffix` compute suffix embeddings"
        media = dict(kwargs)
        self._slice(media, layout, start)  # the items whose placeholders lie in the suffix
        ids = input_ids[:, start:]
        # The model's forward, on the suffix: text embeddings, then each kind's features over its placeholders.
        embeds: torch.Tensor = self.model.get_input_embeddings()(ids)
        inner = self.model.model
        for kind, id_name, pixels_name, grid_name in self._KINDS:
            if media.get(pixels_name) is None:
                continue
            encode = inner.get_image_features if kind == "image" else inner.get_video_features
            output = encode(media[pixels_name], media[grid_name], return_dict=True)
            features = torch.cat(list(output.pooler_output), dim=0).to(embeds.device, embeds.dtype)
            # Each kind has its own placeholder id in the families that declare `embeds_suffix`.
            token_id = config_token_id(self.config, id_name)
            assert token_id is not None, f"{kind} items were laid out without a placeholder id"
            placeholders = torch.eq(ids, token_id)
            mask = placeholders[..., None].expand_as(embeds)
            embeds = embeds.masked_scatter(mask, features)
        return embeds

    def positions(self, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        """Explicit `[4, 1, L]` positions of the whole prompt, never reading `rope_deltas` left on the model."""
        text = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        image_grid, video_grid = kwargs.get("image_grid_thw"), kwargs.get("video_grid_thw")
        if image_grid is None and video_grid is None:
            rope = text[None].expand(3, -1, -1)
        else:
            rope, _ = self.model.model.get_rope_index(
                input_ids,
                mm_token_type_ids=self.token_marks(input_ids),
                image_grid_thw=image_grid,
                video_grid_thw=video_grid,
                **self._rope_kwargs(kwargs),
            )
        return torch.cat([text[None], rope.to(text.dtype)], dim=0)


class Qwen2_5VLMedia(Qwen2VLMedia):
    """Qwen2.5-VL: as Qwen2-VL, plus each video's `second_per_grid_ts` (its temporal position spacing)."""

    handled = Qwen2VLMedia.handled | {"second_per_grid_ts"}

    def _extra(self, kind: str, kwargs: dict[str, Any], index: int) -> tuple[Any, ...]:
        seconds = kwargs.get(self._SECONDS)
        if kind != "video" or seconds is None:
            return ()
        return (torch.as_tensor(seconds[index], dtype=torch.float64),)

    def _rope_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        seconds = kwargs.get(self._SECONDS)
        return {"second_per_grid_ts": seconds} if seconds is not None else {}


class Qwen3VLMedia(Qwen2VLMedia):
    """Qwen3-VL (deepstack, interleaved M-RoPE): images as Qwen2-VL; a video spans all its frames.

    The processor writes each of a video's `t` frames as its own placeholder run, with the
    frame's timestamp text and vision end/start ids between runs. An item spans from its first
    frame's first placeholder to its last frame's last, so no cut falls between frames; the
    text inside that span is hashed with the item, so its symbols still key those tokens.
    """

    def _items(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[KindItems]:
        # Videos are laid out by `layout` (one item across several runs); the base sees images only.
        return [entry for entry in super()._items(tokens, kwargs) if entry[0] == "image"]

    def placeholder_ids(self) -> tuple[int | None, ...]:
        return tuple(config_token_id(self.config, id_name) for _, id_name, _, _ in self._KINDS)

    def layout(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> MediaLayout | None:
        images = super().layout(tokens, kwargs)
        return with_items(images, self._videos(tokens, kwargs))

    def _videos(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[MediaItem] | None:
        """One item per video, from its first frame's placeholders to its last's; None on a mismatch."""
        token_id = config_token_id(self.config, {kind: name for kind, name, _, _ in self._KINDS}["video"])
        runs = self._runs(tokens, "video", token_id) if token_id is not None else []
        pixels, grid = kwargs.get("pixel_values_videos"), kwargs.get("video_grid_thw")
        if pixels is None and grid is None:
            return None if runs else []
        if not isinstance(pixels, torch.Tensor) or not isinstance(grid, torch.Tensor) or grid.dim() != 2:
            return None
        rows = grid.prod(-1).tolist()
        if sum(rows) != pixels.shape[0]:
            return None
        # One placeholder run per frame: h*w/merge placeholders each.
        frame_lens = [h * w // self._merge() for t, h, w in grid.tolist() for _ in range(t)]
        frames = assign_spans(runs, frame_lens)
        if frames is None:
            return None
        items, frame, row = [], 0, 0
        for i, (t, _, _) in enumerate(grid.tolist()):
            start, end = frames[frame][0], frames[frame + t - 1][1]
            span_ids = torch.tensor(list(tokens[start:end]), dtype=torch.long)
            digest = hash_media(pixels[row : row + rows[i]], grid[i], span_ids)
            items.append(MediaItem("video", digest, start, end))
            frame, row = frame + t, row + rows[i]
        return items


class Qwen3_5Media(Qwen3VLMedia):
    """Qwen3.5 (dense and MoE): Qwen3-VL's items and positions, no deepstack, on hybrid text layers.

    Its gated delta-net layers hold recurrent states, so the hook prefills media prompts itself,
    fed the embeddings the forward computes (`suffix_embeds`: text embeddings with the suffix's
    image and video features over their placeholders) at the prompt's M-RoPE positions.
    """

    embeds_suffix = True


register(MediaFamily(("qwen2_vl",), Qwen2VLMedia))
register(MediaFamily(("qwen2_5_vl",), Qwen2_5VLMedia))
# Qwen3-VL's tower, placeholders and `get_rope_index`: Cohere Compass on Cohere 2 text layers,
# Cosmos 3 Omni (its reasoner) under its own config.
register(MediaFamily(("qwen3_vl", "qwen3_vl_moe", "cohere_compass", "cosmos3_omni"), Qwen3VLMedia))
register(MediaFamily(("qwen3_5", "qwen3_5_moe"), Qwen3_5Media))
