"""GenericMedia: one adapter for families whose placeholders take per-item features from a tower.

The common pattern (LLaVA-like): a `generate` kwarg holds the media of a prompt, one item
per leading row (an image, a tile, a video, an audio chunk); the tower encodes each row on its
own; the model scatters the features over the placeholder tokens, in order, with causal
attention. Then a cached prefix may end at any item boundary, and the suffix needs only the
rows of its own items. What differs between families is data: a `FamilyRule`
per family in `generic_table`, its kinds' kwargs and placeholder layouts (`generic_rules`).

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
import math
from collections.abc import Sequence
from typing import Any

import torch

from hf_prefix_cache.errors import UnhashableMediaError
from hf_prefix_cache.multimodal.base import KindItems, MediaAdapter, config_token_id, merge_items, set_or_drop
from hf_prefix_cache.multimodal.generic_rules import FamilyRule, KindRule, config_path
from hf_prefix_cache.multimodal.media import MediaItem, MediaLayout, find_runs, hash_media


class GenericMedia(MediaAdapter):
    """A family served from its `FamilyRule`: rows of per-kind kwargs, each row one item."""

    def __init__(self, model: Any, rule: FamilyRule) -> None:
        super().__init__(model)
        self.rule = rule
        names = (
            name for k in rule.kinds for name in (k.data, k.sizes, k.mask, k.merges, *k.extras) if name is not None
        )
        self.handled = frozenset((*names, *rule.ignored, *(old for old, _ in rule.aliases)))
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
                items = self._grid_items(rule, tokens, kwargs)
                if items is None:
                    return None
                groups.append(items)
        return merge_items(*groups)

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
            if rule.count == "area":
                out.append(self._area_items(rule, kwargs))
            elif rule.count == "thw":
                out.append(self._thw_items(rule, kwargs))
            elif rule.count == "packed":
                out.append(self._packed_items(rule, kwargs))
            elif rule.count == "conv":
                out.append(self._conv_items(rule, kwargs))
            else:
                out.append(self._equal_items(rule, tokens, kwargs))
        return out

    def _equal_items(self, rule: KindRule, tokens: Sequence[int], kwargs: dict[str, Any]) -> KindItems:
        """Every row of `rule.data` one item, all with the same number of placeholders."""
        token_id = config_token_id(self.config, *rule.token_id)
        data = kwargs.get(rule.data)
        if data is None:
            return (rule.kind, token_id, [], [])
        if not isinstance(data, torch.Tensor):
            return (rule.kind, token_id, [(data,)], None)  # let hashing name its type
        if rule.item_axis == 1:
            # One prompt's items side by side: `[1, items, ...]`.
            rows = [(data[0, i],) for i in range(data.shape[1])] if data.dim() >= 2 and data.shape[0] == 1 else None
        else:
            rows = self._rows(rule, data, kwargs)
        total = sum(b - a for a, b in find_runs(tokens, token_id)) if token_id is not None else 0
        if rows is None or not rows or total % len(rows):
            return (rule.kind, None, [], None)
        return (rule.kind, token_id, rows, [total // len(rows)] * len(rows))

    def _area_items(self, rule: KindRule, kwargs: dict[str, Any]) -> KindItems:
        """Every row of `rule.data` one item of ``(h // s) * (w // s)`` placeholders, for valid ``h x w`` patches."""
        token_id = config_token_id(self.config, *rule.token_id)
        data = kwargs.get(rule.data)
        if data is None:
            return (rule.kind, token_id, [], [])
        if not isinstance(data, torch.Tensor):
            return (rule.kind, token_id, [(data,)], None)  # let hashing name its type
        rows, stride = self._rows(rule, data, kwargs), self._product(rule.stride)
        if rows is None or stride is None or rule.sizes is None:
            return (rule.kind, None, [], None)
        counts = []
        for height, width in kwargs[rule.sizes].tolist():  # checked by `_rows`: one valid size per row
            if height % stride or width % stride:
                return (rule.kind, None, [], None)  # the model's own merge of patches fails on these
            counts.append((height // stride) * (width // stride))
        return (rule.kind, token_id, rows, counts)

    def _thw_items(self, rule: KindRule, kwargs: dict[str, Any]) -> KindItems:
        """Every ``(t, h, w)`` row of the grid kwarg one item: its ``t * h * w`` rows of `rule.data`, its grid row."""
        token_id = config_token_id(self.config, *rule.token_id)
        data, grid = kwargs.get(rule.data), kwargs.get(rule.sizes or "")
        if data is None and grid is None:
            return (rule.kind, token_id, [], [])
        if data is not None and not isinstance(data, torch.Tensor):
            return (rule.kind, token_id, [(data,)], None)  # let hashing name its type
        if not isinstance(data, torch.Tensor) or not isinstance(grid, torch.Tensor):
            return (rule.kind, None, [], None)
        if grid.dim() != 2 or grid.shape[-1] not in (2, 3) or grid.is_floating_point() or data.dim() < 1:
            return (rule.kind, None, [], None)
        merges = self._merges(rule, kwargs, grid.shape[0])
        sizes = grid.prod(-1).tolist()
        if merges is None or sum(sizes) != data.shape[0] or any(n <= 0 for n in sizes):
            return (rule.kind, None, [], None)
        offsets = [0, *torch.tensor(sizes).cumsum(0).tolist()]
        own = kwargs.get(rule.merges) if rule.merges is not None else None
        parts = [
            (data[offsets[i] : offsets[i + 1]], grid[i], *((own[i],) if own is not None else ()))
            for i in range(len(sizes))
        ]
        counts = []
        for row, merge in zip(grid.tolist(), merges, strict=True):
            t, h, w = row if len(row) == 3 else (1, *row)
            frame = (1 if rule.pooled_time else t) * h * w
            if frame % merge:
                return (rule.kind, None, [], None)  # the model's own merge of patches fails on these
            counts.append(frame // merge)
        return (rule.kind, token_id, parts, counts)

    def _packed_items(self, rule: KindRule, kwargs: dict[str, Any]) -> KindItems:
        """Every ``(h, w)`` row of the sizes kwarg one item: its ``h * w * p`` columns of the packed row, its size."""
        token_id = config_token_id(self.config, *rule.token_id)
        data, sizes = kwargs.get(rule.data), kwargs.get(rule.sizes or "")
        if data is None and sizes is None:
            return (rule.kind, token_id, [], [])
        if data is not None and not isinstance(data, torch.Tensor):
            return (rule.kind, token_id, [(data,)], None)  # let hashing name its type
        patch, merge = self._product(rule.patch), self._product(rule.stride)
        if not isinstance(data, torch.Tensor) or not isinstance(sizes, torch.Tensor) or patch is None or merge is None:
            return (rule.kind, None, [], None)
        if sizes.dim() != 2 or sizes.shape[-1] != 2 or sizes.is_floating_point() or bool((sizes <= 0).any()):
            return (rule.kind, None, [], None)
        # One packed row (the model reads row 0 only), patches `patch` pixels high, side by side.
        if data.dim() != 4 or data.shape[0] != 1 or data.shape[-2] != patch:
            return (rule.kind, None, [], None)
        areas = sizes.prod(-1).tolist()
        if sum(areas) * patch != data.shape[-1] or any(a % merge for a in areas):
            return (rule.kind, None, [], None)
        offsets = [0, *(torch.tensor(areas).cumsum(0) * patch).tolist()]
        parts = [(data[..., offsets[i] : offsets[i + 1]], sizes[i]) for i in range(len(areas))]
        return (rule.kind, token_id, parts, [a // merge for a in areas])

    def _conv_items(self, rule: KindRule, kwargs: dict[str, Any]) -> KindItems:
        """Every row of `rule.data` one item (hashed whole, with its mask row), its count from its valid frames."""
        token_id = config_token_id(self.config, *rule.token_id)
        data, mask = kwargs.get(rule.data), kwargs.get(rule.mask or "")
        if data is None:
            return (rule.kind, token_id, [], [])
        if not isinstance(data, torch.Tensor):
            return (rule.kind, token_id, [(data,)], None)  # let hashing name its type
        if not isinstance(mask, torch.Tensor) or data.dim() < 2 or mask.dim() != 2:
            return (rule.kind, None, [], None)
        if mask.shape != (data.shape[0], data.shape[rule.frames_axis]) or mask.is_floating_point() or mask.is_complex():
            return (rule.kind, None, [], None)
        steps = list(rule.convs)
        if rule.conv_paths:
            kernels, strides = (config_path(self.config, path) for path in rule.conv_paths)
            if not isinstance(kernels, (list, tuple)) or not isinstance(strides, (list, tuple)):
                return (rule.kind, None, [], None)
            if len(kernels) != len(strides) or not all(isinstance(v, int) and v > 0 for v in (*kernels, *strides)):
                return (rule.kind, None, [], None)
            steps += [(0, kernel, stride) for kernel, stride in zip(kernels, strides, strict=True)]
        counts = []
        for n in (mask.sum(-1) + rule.frames_offset).tolist():
            for padding, kernel, stride in steps:
                n = (n + 2 * padding - kernel) // stride + 1
            if n <= 0:
                return (rule.kind, None, [], None)
            counts.append(int(n))
        return (rule.kind, token_id, [(data[i], mask[i]) for i in range(data.shape[0])], counts)

    def _merges(self, rule: KindRule, kwargs: dict[str, Any], num_items: int) -> list[int] | None:
        """Each item's merge area: its own merge size squared (`rule.merges`), else `rule.stride`'s product."""
        if rule.merges is None:
            merge = self._product(rule.stride) if rule.stride or not rule.merge_area else rule.merge_area
            return None if merge is None else [merge] * num_items
        own = kwargs.get(rule.merges)
        if not isinstance(own, torch.Tensor) or tuple(own.shape) != (num_items,) or own.is_floating_point():
            return None
        if any(m <= 0 for m in own.tolist()):
            return None
        return [int(m) ** 2 for m in own.tolist()]

    def _grid_items(self, rule: KindRule, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[MediaItem] | None:
        """Pixtral-style items: each row `h // s` placeholder runs of `w // s`, one break token between runs.

        Raises:
            UnhashableMediaError: when the rows are not one tensor (a list of images, say).
        """
        token_id = config_token_id(self.config, *rule.token_id)
        runs = find_runs(tokens, token_id) if token_id is not None else []
        data, sizes = kwargs.get(rule.data), kwargs.get(rule.sizes) if rule.sizes is not None else None
        if data is None:
            return None if runs else []
        if not isinstance(data, torch.Tensor):
            raise UnhashableMediaError(f"{rule.data} must be one tensor, not {type(data).__name__}")
        stride = self._product(rule.stride)
        rows = self._rows(rule, data, kwargs)
        if rows is None or stride is None or not isinstance(sizes, torch.Tensor):
            return None
        items: list[MediaItem] = []
        next_run = 0
        for parts, (height, width) in zip(rows, sizes.tolist(), strict=True):
            num_rows, num_cols = int(height) // stride, int(width) // stride
            mine = runs[next_run : next_run + num_rows]
            if num_rows == 0 or num_cols == 0 or len(mine) != num_rows or any(b - a != num_cols for a, b in mine):
                return None
            if any(later[0] - earlier[1] != 1 for earlier, later in zip(mine, mine[1:], strict=False)):
                return None  # rows of one item are separated by exactly one break token
            start, end = mine[0][0], mine[-1][1]
            span_ids = torch.tensor(list(tokens[start:end]), dtype=torch.long)
            items.append(MediaItem(rule.kind, hash_media(*parts, span_ids), start, end))
            next_run += num_rows
        return items if next_run == len(runs) else None

    def _rows(self, rule: KindRule, data: torch.Tensor, kwargs: dict[str, Any]) -> list[tuple[Any, ...]] | None:
        """Per row of `data`, the parts hashed for it: the row cropped to its valid size, and that size."""
        if data.dim() < 1:
            return None
        extras = [kwargs[name] for name in rule.extras if kwargs.get(name) is not None]
        if any(not isinstance(e, torch.Tensor) or e.dim() < 1 or e.shape[0] != data.shape[0] for e in extras):
            return None
        if rule.sizes is None:
            return [(data[i], *(e[i] for e in extras)) for i in range(data.shape[0])]
        if rule.mask is not None:
            return None if extras else self._patch_rows(rule, data, kwargs)
        if extras:
            return None  # no family declares both
        sizes = kwargs.get(rule.sizes)
        patch = self._product(rule.patch) or 1
        if not isinstance(sizes, torch.Tensor) or data.dim() != 4 or tuple(sizes.shape) != (data.shape[0], 2):
            return None
        out: list[tuple[Any, ...]] = []
        for i, (height, width) in enumerate(sizes.tolist()):
            if not 0 < height <= data.shape[-2] or not 0 < width <= data.shape[-1]:
                return None
            # Padding past the valid size never reaches the tower: leave it out of the key.
            rows, cols = int(height) // patch * patch, int(width) // patch * patch
            out.append((data[i, :, :rows, :cols], sizes[i]))
        return out

    def _patch_rows(self, rule: KindRule, data: torch.Tensor, kwargs: dict[str, Any]) -> list[tuple[Any, ...]] | None:
        """NaFlex rows ``[rows, patches, values]``: per row its first ``h * w`` patches and ``(h, w)``."""
        sizes, mask = kwargs.get(rule.sizes) if rule.sizes is not None else None, kwargs.get(rule.mask or "")
        if not isinstance(sizes, torch.Tensor) or not isinstance(mask, torch.Tensor) or data.dim() != 3:
            return None
        if tuple(sizes.shape) != (data.shape[0], 2) or tuple(mask.shape) != tuple(data.shape[:2]):
            return None
        if mask.is_floating_point() or mask.is_complex():
            return None  # not a mask the model takes (it slices features by the mask's sums)
        out: list[tuple[Any, ...]] = []
        for i, (height, width) in enumerate(sizes.tolist()):
            n = int(height) * int(width)
            if height <= 0 or width <= 0 or n > data.shape[1]:
                return None
            # The tower attends to the masked patches and the model keeps the first `mask.sum()` outputs:
            # exactly the first h * w patches must be marked, so the padding after them is never read.
            if not (bool(mask[i, :n].eq(1).all()) and bool(mask[i, n:].eq(0).all())):
                return None
            out.append((data[i, :n], sizes[i]))
        return out

    def _product(self, paths: tuple[str, ...]) -> int | None:
        values: list[Any] = []
        for path in paths:
            value = config_path(self.config, path)
            # A per-axis list (Kimi-K2.5's `merge_kernel_size`) counts as the product of its elements.
            values += list(value) if isinstance(value, (list, tuple)) else [value]
        if not values or not all(isinstance(v, int) and v > 0 for v in values):
            return None
        return int(math.prod(values))

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
        # The model's forward, on the suffix: text embeddings, then each kind's features over its placeholders.
        embeds: torch.Tensor = self.model.get_input_embeddings()(ids)
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
