"""GenericMedia: one adapter for families whose placeholders take per-item features from a tower.

The common pattern (LLaVA-like): a `generate` kwarg holds the media of a prompt, one item
per leading row (an image, a tile, a video, an audio chunk); the tower encodes each row on its
own; the model scatters the features over the placeholder tokens, in order, with causal
attention. Then a cached prefix may end at any item boundary, and the suffix needs only the
rows of its own items. What differs between families is data: a `FamilyRule`
per family in `generic_table`, its kinds' kwargs and placeholder layouts (`generic_rules`);
how each layout cuts a prompt's kwargs into items is `generic_items`.

What is hashed is what the model consumes of an item: its row, cropped to its valid size
(rounded down to whole vision patches) where the processor pads rows to the prompt's largest
item, plus that size. So one picture keys the same in a one-image and a two-image prompt.
Positions are plain 1D positions: M-RoPE families keep their own adapters (`qwen_vl`).

A family whose model embeds a prompt LLaVA-style (`FamilyRule.embeds_suffix`) may also have
its suffix's input embeddings computed here, with the model's own functions, for the hook to
feed a recurrent prefill (`suffix_embeds`).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from hf_prefix_cache import reasons
from hf_prefix_cache.multimodal.base import KindItems, MediaAdapter, config_token_id, merge_items, set_or_drop
from hf_prefix_cache.multimodal.generic_items import grid_items, kind_items
from hf_prefix_cache.multimodal.generic_rules import FamilyRule, config_path
from hf_prefix_cache.multimodal.media import MediaItem, MediaLayout


class GenericMedia(MediaAdapter):
    """A family served from its `FamilyRule`: rows of per-kind kwargs, each row one item."""

    def __init__(self, model: Any, rule: FamilyRule) -> None:
        super().__init__(model)
        self.rule = rule
        names = (
            name for k in rule.kinds for name in (k.data, k.sizes, k.mask, k.merges, *k.extras) if name is not None
        )
        self.handled = frozenset(
            (*names, *rule.ignored, *(old for old, _ in rule.aliases), *(name for name, _ in rule.call_requires))
        )
        self.settings = rule.settings
        assert not rule.embeds_suffix or {k.kind for k in rule.kinds} <= {"image", "video", "audio"}, "no such encoder"
        self.embeds_suffix = rule.embeds_suffix

    # ------------------------------------------------------------------ layout
    def _renamed(self, kwargs: dict[str, Any]) -> dict[str, Any] | None:
        """`kwargs` with deprecated names replaced by the rule's; None when both names are given."""
        out = kwargs
        for old, new in self.rule.aliases:
            if out.get(old) is None:
                continue
            if out.get(new) is not None:
                return None  # two values for one input: leave it to the model, run cold
            out = {k: v for k, v in out.items() if k != old} | {new: out[old]}
        return out

    def layout(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> MediaLayout | None:
        renamed = self._renamed(kwargs)
        if renamed is None:
            return None
        kwargs = renamed
        equal = super().layout(tokens, kwargs)  # the "equal" and "area" kinds, through the base's span assignment
        if equal is None:
            return None
        groups: list[Sequence[MediaItem]] = [equal.items]
        for rule in self.rule.kinds:
            if rule.count == "grid":
                items = grid_items(self.config, rule, tokens, kwargs)
                if items is None:
                    return None
                groups.append(items)
        return merge_items(*groups)

    def why_cold(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> str | None:
        problem = super().why_cold(tokens, kwargs)
        if problem is not None or not any(kwargs.get(rule.data) is not None for rule in self.rule.kinds):
            return problem
        for name, value in self.rule.call_requires:
            passed = kwargs.get(name)
            if passed is not value and passed != value:
                # Left at its default, the encoder samples noise: this call's features repeat no earlier run's.
                return reasons.with_detail(reasons.MEDIA_RANDOM, name)
        return None

    def placeholder_ids(self) -> tuple[int | None, ...]:
        return tuple(config_token_id(self.config, *rule.token_id) for rule in self.rule.kinds)

    def _items(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[KindItems]:
        out: list[KindItems] = []
        for rule in self.rule.kinds:
            if rule.count == "grid":
                continue
            if kwargs.get(rule.data) is None and config_token_id(self.config, *rule.token_id) is None:
                continue  # no media of this kind and no placeholder id in the config: the prompt is text
            if not all(config_path(self.config, path) == value for path, value in rule.requires):
                if kwargs.get(rule.data) is not None:
                    out.append((rule.kind, None, [], None))  # media the layout cannot count: the call runs cold
                continue
            out.append(kind_items(self.config, rule, tokens, kwargs))
        return out

    # ------------------------------------------------------------------- resume
    def resume_kwargs(
        self, input_ids: torch.Tensor, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int
    ) -> dict[str, Any]:
        renamed = self._renamed(kwargs)
        assert renamed is not None, "a prompt with a layout passed each input under one name"
        return super().resume_kwargs(input_ids, renamed, layout, cached_len)

    def _slice(self, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int) -> None:
        for rule in self.rule.kinds:
            data = kwargs.get(rule.data)
            if data is None:
                continue
            k = layout.num_cached(rule.kind, cached_len)
            if rule.count == "thw":
                grid = kwargs[rule.sizes or ""]
                keep = k < grid.shape[0]
                skip = int(grid[:k].prod(-1).sum()) if k else 0  # the cached items' flattened rows
                set_or_drop(kwargs, rule.data, data[skip:], keep)
                set_or_drop(kwargs, rule.sizes or "", grid[k:], keep)
                if rule.merges is not None and kwargs.get(rule.merges) is not None:
                    set_or_drop(kwargs, rule.merges, kwargs[rule.merges][k:], keep)
                continue
            if rule.count == "packed":
                sizes = kwargs[rule.sizes or ""]
                keep = k < sizes.shape[0]
                skip = int(sizes[:k].prod(-1).sum()) * data.shape[-2] if k else 0  # the cached items' columns
                set_or_drop(kwargs, rule.data, data[..., skip:], keep)
                set_or_drop(kwargs, rule.sizes or "", sizes[k:], keep)
                continue
            if rule.item_axis == 1:
                set_or_drop(kwargs, rule.data, data[:, k:], k < data.shape[1])
                continue
            keep = k < data.shape[0]
            set_or_drop(kwargs, rule.data, data[k:], keep)
            for name in (rule.sizes, rule.mask, *rule.extras):
                if name is not None and kwargs.get(name) is not None:
                    set_or_drop(kwargs, name, kwargs[name][k:], keep)

    # -------------------------------------------------------------- embeddings
    def suffix_embeds(
        self, input_ids: torch.Tensor, kwargs: dict[str, Any], layout: MediaLayout, start: int
    ) -> torch.Tensor:
        assert self.embeds_suffix, "only families declaring `embeds_suffix` compute suffix embeddings"
        renamed = self._renamed(kwargs)
        assert renamed is not None, "a prompt with a layout passed each input under one name"
        media = dict(renamed)
        self._slice(media, layout, start)  # the rows whose placeholders lie in the suffix
        ids = input_ids[:, start:]
        # The model's forward, on the suffix: text embeddings, then each kind's features over its placeholders
        # (embedded as id 0 first: a placeholder id may lie past the text vocabulary, Nemotron 3.5 Transcribe's).
        placeholders = [t for t in self.placeholder_ids() if t is not None]
        text_ids = ids.masked_fill(torch.isin(ids, torch.tensor(placeholders, dtype=ids.dtype, device=ids.device)), 0)
        embeds: torch.Tensor = self.model.get_input_embeddings()(text_ids)
        for rule in self.rule.kinds:
            if media.get(rule.data) is None:
                continue
            names = [
                n for n in (rule.data, rule.sizes, rule.mask, rule.merges, *rule.extras) if n is not None and n in media
            ]
            name = f"get_{rule.kind}_features"
            # The model's own encoder, or its base model's where the head class does not forward it (Inkling's audio).
            encode = getattr(self.model, name, None) or getattr(self.model.model, name)
            params = inspect.signature(encode).parameters.values()
            # Ask for an output object where the encoder takes the flag (Inkling's audio encoder returns one anyway).
            takes_flag = any(p.kind is p.VAR_KEYWORD or p.name == "return_dict" for p in params)
            flag = {"return_dict": True} if takes_flag else {}
            pooled = encode(**{n: media[n] for n in names}, **flag).pooler_output
            # One tensor of the items' rows, or one tensor per item: the rows the forward scatters, in order.
            rows = pooled if isinstance(pooled, torch.Tensor) else torch.cat(list(pooled), dim=0)
            features = rows.reshape(-1, embeds.shape[-1]).to(embeds.device, embeds.dtype)
            token_id = config_token_id(self.config, *rule.token_id)
            assert token_id is not None, f"{rule.kind} items were laid out without a placeholder id"
            mask = torch.eq(ids, token_id)[..., None].expand_as(embeds)
            embeds = embeds.masked_scatter(mask, features)
        return embeds
