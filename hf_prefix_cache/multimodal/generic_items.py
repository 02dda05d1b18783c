"""How `GenericMedia` cuts a prompt's media kwargs into items: one function per placeholder layout.

`kind_items` reads what every layout shares (the kind's placeholder id, and no items where the
call passes none) and hands the kind on to its layout's function. Each function reads one
`KindRule` of a family (`generic_rules`) against a model's `config` and a call's kwargs, and
returns the kind's items as `MediaAdapter._items` takes them
(`KindItems`): the parts hashed for each item and its placeholder count, or no placeholder
id where the kwargs do not fit the layout (the call then runs cold). ``"grid"`` items carry
their own spans (`grid_items`). What is hashed is what the tower reads of an item: its row,
cropped to its valid size where the processor pads rows, plus that size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hf_prefix_cache.errors import UnhashableMediaError
from hf_prefix_cache.multimodal.base import KindItems, Padded, config_token_id
from hf_prefix_cache.multimodal.generic_rules import KindRule, config_path
from hf_prefix_cache.multimodal.media import MediaItem, find_runs, hash_media


def kind_items(config: Any, rule: KindRule, tokens: Sequence[int], kwargs: dict[str, Any]) -> KindItems:
    """One kind's items, by its `rule.count` layout (any but ``"grid"``, whose items carry their own spans).

    No items where neither its data kwarg nor its sizes kwarg is passed; data that is no tensor
    is passed on as the one item, for hashing to name its type (`UnhashableMediaError`).
    """
    token_id = config_token_id(config, *rule.token_id)
    data = kwargs.get(rule.data)
    # The layouts that read a sizes kwarg with the data go on with sizes alone, and find them unusable.
    sizes = kwargs.get(rule.sizes or "") if rule.count in ("thw", "packed") else None
    if data is None and sizes is None:
        return (rule.kind, token_id, [], [])
    if data is not None and not isinstance(data, torch.Tensor):
        return (rule.kind, token_id, [(data,)], None)  # let hashing name its type
    return _LAYOUTS[rule.count](config, rule, token_id, tokens, kwargs)


def equal_items(
    config: Any, rule: KindRule, token_id: int | None, tokens: Sequence[int], kwargs: dict[str, Any]
) -> KindItems:
    """Every row of `rule.data` one item, all with the same number of placeholders."""
    data = kwargs[rule.data]
    if rule.item_axis == 1:
        # One prompt's items side by side: `[1, items, ...]`.
        rows = [(data[0, i],) for i in range(data.shape[1])] if data.dim() >= 2 and data.shape[0] == 1 else None
    else:
        rows = _rows(config, rule, data, kwargs)
    total = sum(b - a for a, b in find_runs(tokens, token_id)) if token_id is not None else 0
    if rows is None or not rows or total % len(rows):
        return (rule.kind, None, [], None)
    return (rule.kind, token_id, rows, [total // len(rows)] * len(rows))


def area_items(
    config: Any, rule: KindRule, token_id: int | None, tokens: Sequence[int], kwargs: dict[str, Any]
) -> KindItems:
    """Every row of `rule.data` one item of ``(h // s) * (w // s)`` placeholders, for valid ``h x w`` patches."""
    data = kwargs[rule.data]
    rows, stride = _rows(config, rule, data, kwargs), _product(config, rule.stride)
    if rows is None or stride is None or rule.sizes is None:
        return (rule.kind, None, [], None)
    counts = []
    for height, width in kwargs[rule.sizes].tolist():  # checked by `_rows`: one valid size per row
        if height % stride or width % stride:
            return (rule.kind, None, [], None)  # the model's own merge of patches fails on these
        counts.append((height // stride) * (width // stride))
    return (rule.kind, token_id, rows, counts)


def thw_items(
    config: Any, rule: KindRule, token_id: int | None, tokens: Sequence[int], kwargs: dict[str, Any]
) -> KindItems:
    """Every ``(t, h, w)`` row of the grid kwarg one item: its ``t * h * w`` rows of `rule.data`, its grid row."""
    data, grid = kwargs.get(rule.data), kwargs.get(rule.sizes or "")
    if not isinstance(data, torch.Tensor) or not isinstance(grid, torch.Tensor):
        return (rule.kind, None, [], None)
    if grid.dim() != 2 or grid.shape[-1] not in (2, 3) or grid.is_floating_point() or data.dim() < 1:
        return (rule.kind, None, [], None)
    merges = _merges(config, rule, kwargs, grid.shape[0])
    sizes = grid.prod(-1).tolist()
    if merges is None or sum(sizes) != data.shape[0] or any(n <= 0 for n in sizes):
        return (rule.kind, None, [], None)
    offsets = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    own = kwargs.get(rule.merges) if rule.merges is not None else None
    parts = [
        (data[offsets[i] : offsets[i + 1]], grid[i], *((own[i],) if own is not None else ())) for i in range(len(sizes))
    ]
    counts = []
    for row, merge in zip(grid.tolist(), merges, strict=True):
        t, h, w = row if len(row) == 3 else (1, *row)
        frame = (1 if rule.pooled_time else t) * h * w
        if frame % merge:
            return (rule.kind, None, [], None)  # the model's own merge of patches fails on these
        counts.append(frame // merge)
    return (rule.kind, token_id, parts, counts)


def packed_items(
    config: Any, rule: KindRule, token_id: int | None, tokens: Sequence[int], kwargs: dict[str, Any]
) -> KindItems:
    """Every ``(h, w)`` row of the sizes kwarg one item: its ``h * w * p`` columns of the packed row, its size."""
    data, sizes = kwargs.get(rule.data), kwargs.get(rule.sizes or "")
    patch, merge = _product(config, rule.patch), _product(config, rule.stride)
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


def conv_items(
    config: Any, rule: KindRule, token_id: int | None, tokens: Sequence[int], kwargs: dict[str, Any]
) -> KindItems:
    """Every row of `rule.data` one item (hashed whole, with its mask row), its count from its valid frames."""
    data, mask = kwargs[rule.data], kwargs.get(rule.mask or "")
    if not isinstance(mask, torch.Tensor) or data.dim() < 2 or mask.dim() != 2:
        return (rule.kind, None, [], None)
    if mask.shape[0] != data.shape[0] or mask.is_floating_point() or mask.is_complex():
        return (rule.kind, None, [], None)
    if rule.mask_per_placeholder:
        # The mask is over the tower's outputs: a row's marked ones fill its placeholders.
        marked = mask.sum(-1).tolist()
        if any(n <= 0 for n in marked):
            return (rule.kind, None, [], None)
        return (rule.kind, token_id, [(data[i], mask[i]) for i in range(data.shape[0])], [int(n) for n in marked])
    if mask.shape[1] != data.shape[rule.frames_axis]:
        return (rule.kind, None, [], None)
    steps = list(rule.convs)
    if rule.conv_paths:
        kernels, strides = (config_path(config, path) for path in rule.conv_paths)
        if not isinstance(kernels, (list, tuple)) or not isinstance(strides, (list, tuple)):
            return (rule.kind, None, [], None)
        if len(kernels) != len(strides) or not all(isinstance(v, int) and v > 0 for v in (*kernels, *strides)):
            return (rule.kind, None, [], None)
        steps += [(0, kernel, stride) for kernel, stride in zip(kernels, strides, strict=True)]
    if rule.hop:
        hop = _product(config, rule.hop)
        if hop is None:
            return (rule.kind, None, [], None)
        steps.append((0, 1, hop))  # one placeholder per started hop: (n - 1) // hop + 1
    if rule.chunk:
        return chunked_items(config, rule, token_id, data, mask, steps)
    counts = []
    for n in (mask.sum(-1) + rule.frames_offset).tolist():
        n = _through(n, steps)
        if n <= 0:
            return (rule.kind, None, [], None)
        counts.append(int(n))
    return (rule.kind, token_id, [_padded_row(rule, data, mask, i) for i in range(data.shape[0])], counts)


def _padded_row(rule: KindRule, data: torch.Tensor, mask: torch.Tensor, i: int) -> tuple[Any, ...] | Padded:
    """Row `i` and its mask row, keyed whole (the tower may read the padding); its content, its valid frames."""
    valid = int(mask[i].bool().sum())
    if not bool(mask[i, :valid].bool().all()):
        return (data[i], mask[i])  # not one leading run of valid frames: no content apart from the padding
    axis = rule.frames_axis - 1 if rule.frames_axis > 0 else rule.frames_axis  # within one row
    return Padded((data[i], mask[i]), (data[i].narrow(axis, 0, valid),))


def chunked_items(
    config: Any,
    rule: KindRule,
    token_id: int | None,
    data: torch.Tensor,
    mask: torch.Tensor,
    steps: list[tuple[int, int, int]],
) -> KindItems:
    """Rows read in chunks of `rule.chunk` frames: each row cropped to its valid frames' chunks, counted per chunk.

    The chunks past a row's valid frames hold padding only and give no features, so a clip keys the
    same however far a longer clip of its prompt pads it.
    """
    chunk, frames = _product(config, rule.chunk), data.shape[rule.frames_axis]
    if chunk is None:
        return (rule.kind, None, [], None)
    axis = rule.frames_axis - 1 if rule.frames_axis > 0 else rule.frames_axis  # within one row
    parts: list[tuple[Any, ...] | Padded] = []
    counts = []
    for i, n in enumerate(mask.sum(-1).tolist()):
        kept = -(-int(n) // chunk) * chunk
        # Valid frames first, then padding: else the chunks read are not the first ones.
        if n <= 0 or kept > frames or not bool(mask[i, :n].bool().all()) or bool(mask[i, n:].bool().any()):
            return (rule.kind, None, [], None)
        full, rest = divmod(int(n), chunk)
        counts.append(full * _through(chunk, steps) + (_through(rest, steps) if rest else 0))
        parts.append((data[i].narrow(axis, 0, kept), mask[i, :kept]))
    if any(c <= 0 for c in counts):
        return (rule.kind, None, [], None)
    return (rule.kind, token_id, parts, counts)


#: Each layout's items, as `kind_items` hands a kind on to it (its data a tensor, or absent beside its sizes).
_LAYOUTS: dict[str, Callable[[Any, KindRule, int | None, Sequence[int], dict[str, Any]], KindItems]] = {
    "equal": equal_items,
    "area": area_items,
    "thw": thw_items,
    "packed": packed_items,
    "conv": conv_items,
}


def _through(n: int, steps: Sequence[tuple[int, int, int]]) -> int:
    """`n` frames through convolutions of ``(padding, kernel, stride)``."""
    for padding, kernel, stride in steps:
        n = (n + 2 * padding - kernel) // stride + 1
    return n


def _merges(config: Any, rule: KindRule, kwargs: dict[str, Any], num_items: int) -> list[int] | None:
    """Each item's merge area: its own merge size squared (`rule.merges`), else `rule.stride`'s product."""
    if rule.merges is None:
        merge = _product(config, rule.stride) if rule.stride or not rule.merge_area else rule.merge_area
        return None if merge is None else [merge] * num_items
    own = kwargs.get(rule.merges)
    if not isinstance(own, torch.Tensor) or tuple(own.shape) != (num_items,) or own.is_floating_point():
        return None
    if any(m <= 0 for m in own.tolist()):
        return None
    return [int(m) ** 2 for m in own.tolist()]


def grid_items(config: Any, rule: KindRule, tokens: Sequence[int], kwargs: dict[str, Any]) -> list[MediaItem] | None:
    """Pixtral-style items: each row `h // s` placeholder runs of `w // s`, one break token between runs.

    Raises:
        UnhashableMediaError: when the rows are not one tensor (a list of images, say).
    """
    token_id = config_token_id(config, *rule.token_id)
    runs = find_runs(tokens, token_id) if token_id is not None else []
    data, sizes = kwargs.get(rule.data), kwargs.get(rule.sizes) if rule.sizes is not None else None
    if data is None:
        return None if runs else []
    if not isinstance(data, torch.Tensor):
        raise UnhashableMediaError(f"{rule.data} must be one tensor, not {type(data).__name__}")
    stride = _product(config, rule.stride)
    rows = _rows(config, rule, data, kwargs)
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


def _rows(config: Any, rule: KindRule, data: torch.Tensor, kwargs: dict[str, Any]) -> list[tuple[Any, ...]] | None:
    """Per row of `data`, the parts hashed for it: the row cropped to its valid size, and that size."""
    if data.dim() < 1:
        return None
    extras = [kwargs[name] for name in rule.extras if kwargs.get(name) is not None]
    if any(not isinstance(e, torch.Tensor) or e.dim() < 1 or e.shape[0] != data.shape[0] for e in extras):
        return None
    if rule.sizes is None:
        return [(data[i], *(e[i] for e in extras)) for i in range(data.shape[0])]
    if rule.mask is not None:
        return None if extras else _patch_rows(rule, data, kwargs)
    if extras:
        return None  # no family declares both
    sizes = kwargs.get(rule.sizes)
    patch = _product(config, rule.patch) or 1
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


def _patch_rows(rule: KindRule, data: torch.Tensor, kwargs: dict[str, Any]) -> list[tuple[Any, ...]] | None:
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


def _product(config: Any, paths: tuple[str | int, ...]) -> int | None:
    values: list[Any] = []
    for path in paths:
        value = path if isinstance(path, int) else config_path(config, path)
        # A per-axis list (Kimi-K2.5's `merge_kernel_size`) counts as the product of its elements.
        values += list(value) if isinstance(value, (list, tuple)) else [value]
    if not values or not all(isinstance(v, int) and v > 0 for v in values):
        return None
    return int(math.prod(values))
