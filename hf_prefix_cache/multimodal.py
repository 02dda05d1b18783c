"""MediaAdapter: how one model family's media inputs become keyed items and suffix-only inputs.

For each supported family an adapter knows which `generate` kwargs carry media, which rows of
them make up each item (and so what is hashed: exactly what the model consumes, unpadded),
how many placeholder tokens each item has, how to hand `generate` only the items whose
placeholders lie in the uncached suffix, and, for M-RoPE models, the explicit positions of
the whole prompt. Transformers feeds the model every media kwarg it is given on the first
step and checks that features and placeholders agree, so passing a cached item again fails,
and leaving out one in the suffix silently embeds its placeholders as text.

Knows nothing about the store or the tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .media import MediaItem, MediaLayout, assign_spans, find_runs, hash_media

#: Every kwarg that carries media or media bookkeeping for some model in transformers 5.23.
MEDIA_KWARGS = (
    "pixel_values",
    "pixel_values_videos",
    "image_sizes",
    "image_grid_thw",
    "video_grid_thw",
    "second_per_grid_ts",
    "input_features",
    "input_values",
    "feature_attention_mask",
    "pixel_attention_mask",
    "mm_encoder_outputs",
    "encoder_outputs",
    "token_type_ids",
    "mm_token_type_ids",
    "cross_attention_mask",
    "aspect_ratio_ids",
    "aspect_ratio_mask",
    "image_embeds",
)


# Per media kind: (kind, placeholder id or None when unusable, each item's hashed parts, placeholder counts or None).
_KindItems = tuple[str, int | None, list[tuple[Any, ...]], list[int] | None]


class MediaAdapter:
    """One family's media handling; subclasses fill in the per-family parts.

    `handled` names the kwargs the adapter understands; a call passing any other media kwarg
    runs cold. `has_positions` marks M-RoPE models, whose positions the hook always passes.
    `whole_prompt_only` marks prefix-LM models (the whole prompt attends both ways), which may
    reuse only an identical prompt.
    """

    handled: frozenset[str] = frozenset()
    has_positions = False
    whole_prompt_only = False

    def __init__(self, model: Any) -> None:
        self.model = model
        self.config = model.config

    def layout(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> MediaLayout | None:
        """The media items of a one-row prompt, or None when placeholders and media disagree.

        Raises:
            UnhashableMediaError: when a media input is not a tensor, array or PIL image.
        """
        items: list[MediaItem] = []
        for kind, token_id, parts, lengths in self._items(tokens, kwargs):
            if token_id is None:
                return None
            runs = find_runs(tokens, token_id)
            if not parts and not runs:
                continue
            spans = assign_spans(runs, lengths) if lengths is not None else _one_per_run(runs, len(parts))
            if spans is None or len(spans) != len(parts):
                return None
            items += [MediaItem(kind, hash_media(*p), a, b) for p, (a, b) in zip(parts, spans, strict=True)]
        items.sort(key=lambda item: item.start)
        return MediaLayout(tuple(items))

    def resume_kwargs(
        self, input_ids: torch.Tensor, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int
    ) -> dict[str, Any]:
        """`kwargs` for a `generate` whose cache holds the first `cached_len` positions (> 0)."""
        out = dict(kwargs)
        self._slice(out, layout, cached_len)
        return out

    def manual_problem(self, tokens: Sequence[int]) -> str | None:
        """Why `lookup`/`insert` (which key token ids only) cannot serve `tokens` exactly, or None."""
        if self.has_positions:
            return "mrope_positions"
        if self.whole_prompt_only:
            return "prefix_lm"
        ids = {t for t in self.placeholder_ids() if t is not None}
        if any(t in ids for t in tokens):
            return "media_placeholders"
        return None

    def placeholder_ids(self) -> tuple[int | None, ...]:
        """The token ids that stand for media in this family's prompts."""
        return tuple(token_id for _, token_id, _, _ in self._items((), {}))

    # --------------------------------------------------------------- per family
    def _items(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[_KindItems]:
        """Per media kind, the items of `kwargs`; counts None means one item per placeholder run."""
        raise NotImplementedError

    def _slice(self, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int) -> None:
        """Keep only the suffix's items in `kwargs` (in place)."""
        raise NotImplementedError


def _one_per_run(runs: Sequence[tuple[int, int]], num_items: int) -> list[tuple[int, int]] | None:
    return list(runs) if len(runs) == num_items else None


def _token_id(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def _set_or_drop(kwargs: dict[str, Any], name: str, value: Any, keep: bool) -> None:
    if keep:
        kwargs[name] = value
    else:
        kwargs.pop(name, None)


class LlavaMedia(MediaAdapter):
    """LLaVA: `pixel_values` `[num_images, C, H, W]`, every image the same number of placeholders."""

    handled = frozenset({"pixel_values"})

    def _items(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[_KindItems]:
        token_id = _token_id(self.config, "image_token_id", "image_token_index")
        pixels = kwargs.get("pixel_values")
        if pixels is None:
            return [("image", token_id, [], [])]
        if not isinstance(pixels, torch.Tensor):
            return [("image", token_id, [(pixels,)], None)]  # let hashing name its type
        # All images have one placeholder count, so adjacent images in one run can be told apart.
        num = pixels.shape[0]
        total = sum(b - a for a, b in find_runs(tokens, token_id)) if token_id is not None else 0
        if num == 0 or total % num:
            return [("image", None, [], None)]
        return [("image", token_id, [(pixels[i],) for i in range(num)], [total // num] * num)]

    def _slice(self, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int) -> None:
        pixels = kwargs.get("pixel_values")
        if pixels is None:
            return
        k = layout.num_cached("image", cached_len)
        _set_or_drop(kwargs, "pixel_values", pixels[k:], k < pixels.shape[0])


class Gemma3Media(LlavaMedia):
    """Gemma 3: LLaVA-like pixels; image blocks attend both ways, so `token_type_ids` go through whole.

    A cut never falls inside a placeholder span, so a cached block was always computed whole.
    """

    handled = frozenset({"pixel_values", "token_type_ids"})


class PaliGemmaMedia(LlavaMedia):
    """PaliGemma: the prompt is one bidirectional prefix, so only an identical prompt is reused."""

    handled = frozenset({"pixel_values", "token_type_ids"})
    whole_prompt_only = True


class Idefics3Media(MediaAdapter):
    """Idefics3 / SmolVLM: `pixel_values` `[1, num_crops, C, H, W]`; each crop is an item.

    The processor splits an image into crops, each with its own placeholder run, and the
    vision model encodes crops one by one, so a cached prefix may end between two crops.
    """

    handled = frozenset({"pixel_values", "pixel_attention_mask"})

    def _items(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[_KindItems]:
        token_id = _token_id(self.config, "image_token_id")
        pixels, mask = kwargs.get("pixel_values"), kwargs.get("pixel_attention_mask")
        if pixels is None:
            return [("image", token_id, [], [])]
        if not isinstance(pixels, torch.Tensor) or pixels.dim() != 5 or pixels.shape[0] != 1 or token_id is None:
            return [("image", None, [], None)]
        num = pixels.shape[1]
        total = sum(b - a for a, b in find_runs(tokens, token_id))
        # All-zero crops are batch padding, which the model drops: they have no placeholders.
        if num == 0 or total % num or bool((pixels == 0).flatten(2).all(-1).any()):
            return [("image", None, [], None)]
        parts = [(pixels[0, i], *((mask[0, i],) if mask is not None else ())) for i in range(num)]
        return [("image", token_id, parts, [total // num] * num)]

    def _slice(self, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int) -> None:
        pixels, mask = kwargs.get("pixel_values"), kwargs.get("pixel_attention_mask")
        if pixels is None:
            return
        k = layout.num_cached("image", cached_len)
        keep = k < pixels.shape[1]
        _set_or_drop(kwargs, "pixel_values", pixels[:, k:], keep)
        if mask is not None:
            _set_or_drop(kwargs, "pixel_attention_mask", mask[:, k:], keep)


class LlavaNextMedia(MediaAdapter):
    """LLaVA-NeXT: anyres patch stacks padded per prompt; an item is its valid patches plus its size."""

    handled = frozenset({"pixel_values", "image_sizes"})

    def _num_patches(self, image_sizes: torch.Tensor) -> list[int]:
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        return [
            image_size_to_num_patches(
                image_size=size,
                grid_pinpoints=self.config.image_grid_pinpoints,
                patch_size=self.config.vision_config.image_size,
            )
            for size in image_sizes
        ]

    def _items(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[_KindItems]:
        token_id = _token_id(self.config, "image_token_id", "image_token_index")
        pixels, sizes = kwargs.get("pixel_values"), kwargs.get("image_sizes")
        if pixels is None:
            return [("image", token_id, [], None)]
        if not isinstance(pixels, torch.Tensor) or not isinstance(sizes, torch.Tensor) or pixels.dim() not in (4, 5):
            return [("image", None, [], None)]
        counts = self._num_patches(sizes)
        if pixels.dim() == 5:
            parts = [(pixels[i, :n], sizes[i]) for i, n in enumerate(counts)]
        else:
            offsets = [0, *torch.tensor(counts).cumsum(0).tolist()]
            parts = [(pixels[offsets[i] : offsets[i + 1]], sizes[i]) for i in range(len(counts))]
        return [("image", token_id, parts, None)]

    def _slice(self, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int) -> None:
        pixels, sizes = kwargs.get("pixel_values"), kwargs.get("image_sizes")
        if pixels is None or sizes is None:
            return
        k = layout.num_cached("image", cached_len)
        keep = k < sizes.shape[0]
        if pixels.dim() == 4:
            skip = sum(self._num_patches(sizes[:k]))
            pixels_left = pixels[skip:]
        else:
            pixels_left = pixels[k:]
        _set_or_drop(kwargs, "pixel_values", pixels_left, keep)
        _set_or_drop(kwargs, "image_sizes", sizes[k:], keep)


class LlavaNextVideoMedia(LlavaNextMedia):
    """LLaVA-NeXT-Video: LLaVA-NeXT images plus `pixel_values_videos` `[num_videos, frames, C, H, W]`.

    Videos of one call are stacked, so they all have one placeholder count.
    """

    handled = LlavaNextMedia.handled | {"pixel_values_videos"}

    def _items(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[_KindItems]:
        token_id = _token_id(self.config, "video_token_id", "video_token_index")
        videos = kwargs.get("pixel_values_videos")
        if videos is None:
            video: _KindItems = ("video", token_id, [], [])
        elif not isinstance(videos, torch.Tensor) or videos.dim() != 5 or token_id is None:
            video = ("video", None, [], None)
        else:
            num = videos.shape[0]
            total = sum(b - a for a, b in find_runs(tokens, token_id))
            if num == 0 or total % num:
                video = ("video", None, [], None)
            else:
                video = ("video", token_id, [(videos[i],) for i in range(num)], [total // num] * num)
        return [*super()._items(tokens, kwargs), video]

    def _slice(self, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int) -> None:
        super()._slice(kwargs, layout, cached_len)
        videos = kwargs.get("pixel_values_videos")
        if videos is not None:
            k = layout.num_cached("video", cached_len)
            _set_or_drop(kwargs, "pixel_values_videos", videos[k:], k < videos.shape[0])


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

    def _items(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[_KindItems]:
        out: list[_KindItems] = []
        for kind, id_name, pixels_name, grid_name in self._KINDS:
            token_id = _token_id(self.config, id_name)
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
            _set_or_drop(kwargs, pixels_name, pixels[skip:], keep)
            _set_or_drop(kwargs, grid_name, grid[k:], keep)
            if kind == "video" and kwargs.get("second_per_grid_ts") is not None:
                _set_or_drop(kwargs, "second_per_grid_ts", kwargs["second_per_grid_ts"][k:], keep)

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
                token_id = _token_id(self.config, id_name)
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


class Qwen2AudioMedia(MediaAdapter):
    """Qwen2-Audio: one row of `input_features` (fixed-length mel frames) and its frame mask per clip."""

    handled = frozenset({"input_features", "feature_attention_mask"})

    def _items(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[_KindItems]:
        token_id = _token_id(self.config, "audio_token_id", "audio_token_index")
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
        features, mask = kwargs.get("input_features"), kwargs.get("feature_attention_mask")
        if features is None or mask is None:
            return
        k = layout.num_cached("audio", cached_len)
        keep = k < features.shape[0]
        _set_or_drop(kwargs, "input_features", features[k:], keep)
        _set_or_drop(kwargs, "feature_attention_mask", mask[k:], keep)


_ADAPTERS: dict[str, type[MediaAdapter]] = {
    "llava": LlavaMedia,
    "gemma3": Gemma3Media,
    "paligemma": PaliGemmaMedia,
    "llava_next": LlavaNextMedia,
    "llava_next_video": LlavaNextVideoMedia,
    "qwen2_vl": Qwen2VLMedia,
    "qwen2_5_vl": Qwen2_5VLMedia,
    "qwen3_vl": Qwen3VLMedia,
    "qwen2_audio": Qwen2AudioMedia,
    "idefics3": Idefics3Media,
    "smolvlm": Idefics3Media,
}


def media_adapter_for(model: Any) -> MediaAdapter | None:
    """The adapter of `model`'s family, or None when its media cannot be served exactly."""
    cls = _ADAPTERS.get(getattr(model.config, "model_type", ""))
    return cls(model) if cls is not None else None
