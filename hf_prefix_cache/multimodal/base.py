"""MediaAdapter: how one model family's media inputs become keyed items and suffix-only inputs.

For each supported family an adapter knows which `generate` kwargs carry media, which rows of
them make up each item (and so what is hashed: exactly what the model consumes, unpadded),
how many placeholder tokens each item has, how to hand `generate` only the items whose
placeholders lie in the uncached suffix, and, for M-RoPE models, the explicit positions of
the whole prompt. Transformers feeds the model every media kwarg it is given on the first
step and checks that features and placeholders agree, so passing a cached item again fails,
and leaving out one in the suffix silently embeds its placeholders as text.

This module holds the base class and the helpers the family modules share. Knows nothing
about the store or the tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_prefix_cache import reasons
from hf_prefix_cache.multimodal.media import MediaItem, MediaLayout, assign_spans, find_runs, hash_media

#: Kwargs that carry media or media bookkeeping for models in transformers 5.23, served or not; a
#: family's own further kwargs are declared in its `registry` row (`MediaFamily.kwargs`), and
#: `multimodal.MEDIA_KWARGS` is this tuple followed by those.
SHARED_MEDIA_KWARGS = (
    "pixel_values",
    "pixel_values_videos",
    "pixel_values_images",
    "high_res_pixel_values",
    "image_patches",
    "target_sizes",
    "target_sizes_videos",
    "image_sizes",
    "image_grid_thw",
    "image_grid_hw",
    "video_grid_thw",
    "second_per_grid_ts",
    "video_second_per_grid",
    "use_audio_in_video",
    "input_features",
    "input_values",
    "padding_mask",
    "feature_attention_mask",
    "audio_feature_lengths",
    "pixel_attention_mask",
    "mm_encoder_outputs",
    "encoder_outputs",
    "token_type_ids",
    "mm_token_type_ids",
    "cross_attention_mask",
    "aspect_ratio_ids",
    "aspect_ratio_mask",
    "cross_attention_states",
    "image_embeds",
    "batch_num_images",
    "image_position_ids",
    "video_position_ids",
    "num_frames_per_video",
    "input_features_mask",
    "image_merge_sizes",
    "video_merge_sizes",
    "video_compression_mask",
    "image_pixel_values",
    "image_attention_mask",
    "audio_input_features",
    "audio_input_ids",
    "audio_input_ids_mask",
    "audio_embed_sizes",
    "audio_attention_mask",
)


@dataclass(frozen=True, slots=True)
class Padded:
    """An item's hashed `parts`, which hold padding its model reads, and the parts of its `content` alone.

    Its key is `parts`; `content` tells a stored item padded otherwise (`MediaItem.unpadded`), so reuse
    lost to a re-padded item is counted (`reasons.MEDIA_PADDING`).
    """

    parts: tuple[Any, ...]
    content: tuple[Any, ...]


# Per media kind: (kind, placeholder id or None when unusable, each item's hashed parts, placeholder counts or None).
KindItems = tuple[str, int | None, Sequence[tuple[Any, ...] | Padded], list[int] | None]


def hashed_parts(part: tuple[Any, ...] | Padded) -> tuple[Any, ...]:
    """An item's hashed parts: a `Padded` item's with its padding, any other's as they are."""
    return part.parts if isinstance(part, Padded) else part


def media_item(kind: str, parts: tuple[Any, ...] | Padded, start: int, end: int) -> MediaItem:
    """The item of `parts` whose placeholders span `[start, end)`."""
    if isinstance(parts, Padded):
        return MediaItem(kind, hash_media(*parts.parts), start, end, hash_media(*parts.content))
    return MediaItem(kind, hash_media(*parts), start, end)


class MediaAdapter:
    """One family's media handling; subclasses fill in the per-family parts.

    `handled` names the kwargs the adapter understands; a call passing any other media kwarg
    runs cold. `has_positions` marks M-RoPE models, whose positions the hook always passes.
    `whole_prompt_only` marks prefix-LM models (the whole prompt attends both ways), which may
    reuse only an identical prompt. `marks_kwarg` names the processor's per-token modality marks
    (`mm_token_type_ids`, Gemma 3's `token_type_ids`), which change positions or attention: a
    call with media must pass exactly the processor's marks (`marks`: config names of a token id
    and its code), or it runs cold. `settings` names `generate` kwargs that override a config
    value and change how media are encoded; a call overriding one runs cold. `new_item_reason`,
    for families whose every position depends on all media of the prompt (`scope`), names the
    event counted when a prompt adds media to a conversation whose earlier media are stored.
    `embeds_suffix` marks families whose suffix embeddings `suffix_embeds` computes as the
    model's forward would, so a model with recurrent layers may prefill media prompts itself
    (at the positions `prefill_positions` gives, for families whose positions are not counts).
    """

    handled: frozenset[str] = frozenset()
    settings: tuple[str, ...] = ()
    marks_kwarg: str | None = None
    marks: tuple[tuple[tuple[str, ...], int], ...] = ()
    has_positions = False
    whole_prompt_only = False
    new_item_reason: str | None = None
    embeds_suffix = False

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
            runs = self._runs(tokens, kind, token_id)
            if not parts and not runs:
                continue
            spans = assign_spans(runs, lengths) if lengths is not None else one_per_run(runs, len(parts))
            if spans is None or len(spans) != len(parts):
                return None
            items += [media_item(kind, p, a, b) for p, (a, b) in zip(parts, spans, strict=True)]
        items.sort(key=lambda item: item.start)
        return MediaLayout(tuple(items))

    def resume_kwargs(
        self, input_ids: torch.Tensor, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int
    ) -> dict[str, Any]:
        """`kwargs` for a `generate` whose cache holds the first `cached_len` positions (> 0)."""
        out = dict(kwargs)
        self._slice(out, layout, cached_len)
        return out

    def suffix_embeds(
        self, input_ids: torch.Tensor, kwargs: dict[str, Any], layout: MediaLayout, start: int
    ) -> torch.Tensor:
        """The `inputs_embeds` the model's forward computes for prompt positions `[start, n)`, `[1, n - start, d]`.

        Text embeddings with the features of the suffix's items (those past `start`, which never
        falls inside a span) over their placeholders; only for adapters with `embeds_suffix`.
        """
        raise NotImplementedError

    def prefill_positions(self, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor | None:
        """Explicit `position_ids` of the whole prompt for a state prefill's chunks (sliced per chunk), or None.

        None (the default) means positions count tokens; M-RoPE families give their `[4, 1, n]` positions.
        """
        return None

    def why_cold(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> str | None:
        """Why a prompt whose media fit its placeholders still cannot reuse exactly, or None."""
        for name in self.settings:
            value = kwargs.get(name)
            if value is not None and value != getattr(self.config, name, None):
                # Items are keyed by content only, so states encoded under other settings must not be reused.
                return reasons.with_detail(reasons.VISION_SETTINGS, name)
        if self.marks_kwarg is not None and self._has_media(kwargs):
            # The marks decide positions or attention; the key assumes the processor's, so require them.
            marks = kwargs.get(self.marks_kwarg)
            if marks is None:
                return reasons.marks_missing(self.marks_kwarg)
            expected = self.token_marks(torch.tensor([list(tokens)], dtype=torch.long))
            if not isinstance(marks, torch.Tensor) or not torch.equal(marks.detach().cpu().to(torch.int), expected):
                return reasons.marks_differ(self.marks_kwarg)
        return None

    def token_marks(self, input_ids: torch.Tensor) -> torch.Tensor:
        """What the processor puts in `marks_kwarg` for `input_ids`: per `marks`, its code on its token ids."""
        marks = torch.zeros_like(input_ids, dtype=torch.int)
        for id_names, code in self.marks:
            token_id = config_token_id(self.config, *id_names)
            if token_id is not None:
                marks[input_ids == token_id] = code
        return marks

    def _has_media(self, kwargs: dict[str, Any]) -> bool:
        return any(kwargs.get(name) is not None for name in self.handled if name != self.marks_kwarg)

    def prompt_parts(self, kwargs: dict[str, Any]) -> list[Any]:
        """For `whole_prompt_only` families: what besides the prompt's symbols its namespace holds."""
        return []

    def scope(self, items: Sequence[MediaItem]) -> list[str]:
        """Namespace parts for a prompt with media `items`: entries are shared only within one scope.

        Empty (the default) when a position's states depend only on the media before it.
        """
        return []

    def item_layers(self) -> tuple[int, ...]:
        """Cache layers that hold states computed from media items alone (cross-attention), by index."""
        return ()

    def manual_problem(self, tokens: Sequence[int]) -> str | None:
        """Why `lookup`/`insert` (which key token ids only) cannot serve `tokens` exactly, or None."""
        if self.has_positions:
            return reasons.MROPE_POSITIONS
        if self.whole_prompt_only:
            return reasons.PREFIX_LM
        ids = {t for t in self.placeholder_ids() if t is not None}
        if any(t in ids for t in tokens):
            return reasons.MEDIA_PLACEHOLDERS
        return None

    def placeholder_ids(self) -> tuple[int | None, ...]:
        """The token ids that stand for media in this family's prompts."""
        return tuple(token_id for _, token_id, _, _ in self._items((), {}))

    # --------------------------------------------------------------- per family
    def _runs(self, tokens: Sequence[int], kind: str, token_id: int) -> list[tuple[int, int]]:
        """The placeholder runs of `kind` items: every run of `token_id`, unless one id serves two kinds."""
        return find_runs(tokens, token_id)

    def _items(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[KindItems]:
        """Per media kind, the items of `kwargs`; counts None means one item per placeholder run."""
        raise NotImplementedError

    def _slice(self, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int) -> None:
        """Keep only the suffix's items in `kwargs` (in place)."""
        raise NotImplementedError


def merge_items(*groups: Sequence[MediaItem]) -> MediaLayout | None:
    """One layout of items laid out separately, in prompt order; None when two of them overlap."""
    items = sorted((item for group in groups for item in group), key=lambda item: item.start)
    if any(a.end > b.start for a, b in zip(items, items[1:], strict=False)):
        return None
    return MediaLayout(tuple(items))


def with_items(layout: MediaLayout | None, items: Sequence[MediaItem] | None) -> MediaLayout | None:
    """`layout` joined by `items` laid out apart from it, in prompt order; None when either is None or two overlap."""
    if layout is None or items is None:
        return None
    return merge_items(layout.items, items)


def untensored_items(runs: Sequence[tuple[int, int]], data: Any, *companions: Any) -> list[MediaItem] | None:
    """A kind's items where its `data` kwarg is no tensor: none where neither it, its `companions` nor a
    placeholder run of the kind is in the prompt; else None (placeholders and media disagree: the call runs cold).

    Raises:
        UnhashableMediaError: `data` is of a type hashing cannot take (the error names the type).
    """
    if data is None:
        return None if runs or any(companion is not None for companion in companions) else []
    hash_media(data)  # raises UnhashableMediaError naming the type; a hashable non-tensor is still not read
    return None


def one_per_run(runs: Sequence[tuple[int, int]], num_items: int) -> list[tuple[int, int]] | None:
    return list(runs) if len(runs) == num_items else None


def config_token_id(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def set_or_drop(kwargs: dict[str, Any], name: str, value: Any, keep: bool) -> None:
    if keep:
        kwargs[name] = value
    else:
        kwargs.pop(name, None)


def drop_cached_rows(kwargs: dict[str, Any], names: Sequence[str], num_cached: int, axis: int = 0) -> None:
    """Keep in `kwargs` (in place) only the rows past the first `num_cached` of each of `names`, along `axis`.

    The first name holds one row per item: absent, nothing changes; with no item left, every one of
    `names` is dropped (the suffix passes none of the kind). Names absent from `kwargs` stay absent.
    """
    lead = kwargs.get(names[0])
    if lead is None:
        return
    keep = num_cached < lead.shape[axis]
    rest: Any = (slice(None),) * axis + (slice(num_cached, None),) if axis else slice(num_cached, None)
    for name in names:
        if kwargs.get(name) is not None:
            set_or_drop(kwargs, name, kwargs[name][rest], keep)
