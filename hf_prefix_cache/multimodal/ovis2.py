"""Ovis2: images as probabilistic visual tokens, each framed by visual-indicator ids that take vision embeddings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hf_prefix_cache import reasons
from hf_prefix_cache.multimodal.base import MediaAdapter, config_token_id, set_or_drop
from hf_prefix_cache.multimodal.media import MediaItem, MediaLayout, hash_media
from hf_prefix_cache.multimodal.registry import MediaFamily, register

# One image's tokens: (start, end, placeholders among them).
_Span = tuple[int, int, int]


class Ovis2Media(MediaAdapter):
    """Ovis2: `pixel_values` `[rows, C, H, W]`, an image its global view and then its tiles, one row each.

    The processor writes an image as one stretch of ids: a start indicator, a row's placeholders,
    a grid indicator, then its tiles' placeholders separated by column and row indicators, and an
    end indicator. The tower encodes each row on its own into the same number of placeholders.
    When a call passes pixels, every visual-indicator id of the prompt is embedded from the
    vision embedding table (a constant per indicator); without pixels, as text. So an item spans
    its whole stretch, indicators included (their ids hashed with its rows), and a prompt with
    media whose indicator ids are not all inside such stretches runs cold: a suffix never holds
    the indicators of a cached image, and one holding a new image gets its pixels.
    """

    handled = frozenset({"pixel_values"})

    def _indicators(self) -> frozenset[int]:
        ids = getattr(self.config, "visual_indicator_token_ids", None) or ()
        return frozenset(int(i) for i in ids)

    def placeholder_ids(self) -> tuple[int | None, ...]:
        return (config_token_id(self.config, "image_token_id"), *sorted(self._indicators()))

    def _stretches(self, tokens: Sequence[int]) -> list[_Span] | None:
        """Each maximal run of placeholder and indicator ids, with its placeholders; None without a placeholder id."""
        atom = config_token_id(self.config, "image_token_id")
        if atom is None:
            return None
        framing = self._indicators() | {atom}
        out: list[_Span] = []
        start = None
        for i, token in enumerate([*tokens, None]):
            if token in framing and start is None:
                start = i
            elif token not in framing and start is not None:
                out.append((start, i, sum(t == atom for t in tokens[start:i])))
                start = None
        return out

    def _rows(self, stretches: Sequence[_Span], num_rows: int) -> list[int] | None:
        """Each stretch's rows of `pixel_values`: its placeholders over a row's; None when they do not fit."""
        total = sum(atoms for _, _, atoms in stretches)
        if num_rows <= 0 or total % num_rows:
            return None
        per_row = total // num_rows
        if any(atoms == 0 or atoms % per_row for _, _, atoms in stretches):
            return None  # indicator ids outside an image, or an image with a partial row
        return [atoms // per_row for _, _, atoms in stretches]

    def layout(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> MediaLayout | None:
        pixels = kwargs.get("pixel_values")
        stretches = self._stretches(tokens)
        if pixels is None:
            # Text only: indicator ids embed as text in every run, cached or not.
            return MediaLayout(()) if stretches is not None and not stretches else None
        if not isinstance(pixels, torch.Tensor):
            hash_media(pixels)  # raises UnhashableMediaError naming its type
            return None
        if stretches is None or pixels.dim() != 4 or not stretches:
            return None
        rows = self._rows(stretches, pixels.shape[0])
        if rows is None:
            return None
        items, row = [], 0
        for (start, end, _), n in zip(stretches, rows, strict=True):
            span_ids = torch.tensor(list(tokens[start:end]), dtype=torch.long)
            items.append(MediaItem("image", hash_media(pixels[row : row + n], span_ids), start, end))
            row += n
        return MediaLayout(tuple(items))

    def why_cold(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> str | None:
        problem = super().why_cold(tokens, kwargs)
        tokenize = getattr(getattr(self.config, "vision_config", None), "tokenize_function", None)
        if problem is None and kwargs.get("pixel_values") is not None and tokenize == "gumbel_argmax":
            # Gumbel noise on every visual token: no two runs of a prompt with images agree.
            return reasons.with_detail(reasons.MEDIA_RANDOM, "tokenize_function")
        return problem

    def resume_kwargs(
        self, input_ids: torch.Tensor, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int
    ) -> dict[str, Any]:
        out = dict(kwargs)
        pixels = out.get("pixel_values")
        if pixels is None:
            return out
        stretches = self._stretches(input_ids[0].tolist())
        rows = self._rows(stretches, pixels.shape[0]) if stretches is not None else None
        assert rows is not None, "a prompt with a layout has its rows laid out"
        skip = sum(rows[: layout.num_cached("image", cached_len)])
        set_or_drop(out, "pixel_values", pixels[skip:], skip < pixels.shape[0])
        return out


register(MediaFamily(("ovis2",), Ovis2Media))
