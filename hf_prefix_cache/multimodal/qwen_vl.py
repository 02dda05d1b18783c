"""The Qwen-VL family: flattened patch rows per item and explicit M-RoPE positions."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..media import MediaLayout
from .base import KindItems, MediaAdapter, config_token_id, set_or_drop


class Qwen2VLMedia(MediaAdapter):
    """Qwen2-VL: flattened patch rows per item from `*_grid_thw`; M-RoPE positions over the whole prompt."""

    handled = frozenset(
        {"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "mm_token_type_ids"}
    )
    has_positions = True
    _KINDS = (
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
            offsets = [0, *torch.tensor(rows).cumsum(0).tolist()]
            parts = [
                (pixels[offsets[i] : offsets[i + 1]], grid[i], *self._extra(kind, kwargs, i)) for i in range(len(rows))
            ]
            out.append((kind, token_id, parts, [n // self._merge() for n in rows]))
        return out

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
            if kind == "video" and kwargs.get("second_per_grid_ts") is not None:
                set_or_drop(kwargs, "second_per_grid_ts", kwargs["second_per_grid_ts"][k:], keep)

    def resume_kwargs(
        self, input_ids: torch.Tensor, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int
    ) -> dict[str, Any]:
        # Positions come from all grids, so compute them before slicing: [4, 1, L] = text row + 3 M-RoPE rows.
        positions = self.positions(input_ids, kwargs)
        out = super().resume_kwargs(input_ids, kwargs, layout, cached_len)
        out["position_ids"] = positions
        return out

    def positions(self, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        """Explicit `[4, 1, L]` positions of the whole prompt, never reading `rope_deltas` left on the model."""
        text = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        image_grid, video_grid = kwargs.get("image_grid_thw"), kwargs.get("video_grid_thw")
        if image_grid is None and video_grid is None:
            rope = text[None].expand(3, -1, -1)
        else:
            types = torch.zeros_like(input_ids, dtype=torch.int)
            for kind, id_name, _, _ in self._KINDS:
                token_id = config_token_id(self.config, id_name)
                types[input_ids == token_id] = 1 if kind == "image" else 2
            rope, _ = self.model.model.get_rope_index(
                input_ids,
                mm_token_type_ids=types,
                image_grid_thw=image_grid,
                video_grid_thw=video_grid,
                **self._rope_kwargs(kwargs),
            )
        return torch.cat([text[None], rope.to(text.dtype)], dim=0)


class Qwen2_5VLMedia(Qwen2VLMedia):
    """Qwen2.5-VL: as Qwen2-VL, plus each video's `second_per_grid_ts` (its temporal position spacing)."""

    handled = Qwen2VLMedia.handled | {"second_per_grid_ts"}

    def _extra(self, kind: str, kwargs: dict[str, Any], index: int) -> tuple[Any, ...]:
        seconds = kwargs.get("second_per_grid_ts")
        if kind != "video" or seconds is None:
            return ()
        return (torch.as_tensor(seconds[index], dtype=torch.float64),)

    def _rope_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        seconds = kwargs.get("second_per_grid_ts")
        return {"second_per_grid_ts": seconds} if seconds is not None else {}


class Qwen3VLMedia(Qwen2VLMedia):
    """Qwen3-VL images (deepstack, interleaved M-RoPE). Videos, whose frames are separate
    placeholder runs with timestamps between them, are not served yet (they run cold)."""

    handled = frozenset({"pixel_values", "image_grid_thw", "mm_token_type_ids"})
