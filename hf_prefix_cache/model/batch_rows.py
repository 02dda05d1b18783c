"""Batches restored row by row: rows loaded behind their left padding, a row copied out alone, rows trimmed.

Functions over a `WorkingCache` whose layers keep per-token keys (`ModelProfile.expands`) or join
recurrent states by row (`ModelProfile.joins_rows`): the hooks' own-rows and state-rows modes restore
each row's prefix into a batch (`restore_rows`), store a row alone (`copy_row`) and keep a prompt's rows
after beams expanded them (`trim`). They read and write the layers only through the adapters.

Example:
    >>> from hf_prefix_cache.model import batch_rows
    >>> batch_rows.restore_rows  # doctest: +ELLIPSIS
    <function restore_rows at ...>
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.model.layers.recurrent import join_rows, select_row
from hf_prefix_cache.model.working_cache import WorkingCache


def restore_rows(cache: WorkingCache, parts: Sequence[tuple[WorkingCache, int]], length: int, expand: int = 1) -> None:
    """Load a batch whose rows were restored one by one: each part's cache behind its left padding.

    Row `i` of the batch holds `parts[i]`'s first `length - pad` positions at columns `[pad, length)`
    and zeros at its padding columns (masked: attention gives them no weight); each row is repeated
    `expand` times (beams, several sequences). Where every layer keeps per-token keys
    (`ModelProfile.expands`), a part may hold more positions than its row takes; models with recurrent
    states (`ModelProfile.joins_rows`) join each part's states too, so each part must hold exactly
    `length - pad` positions (its row prefilled alone up to that column). Copies: the rows' stored
    tensors are never written.

    ``` text
    part 0, pad 0:  [ k0 k1 k2 k3 k4 ]      length 5
    part 1, pad 2:  [ 0  0  k0 k1 k2 ]
    ```
    """
    if not (cache.profile.expands or cache.profile.joins_rows):
        raise InconsistentStateError("these layers cannot be restored row by row")
    for i, (layer, adapter) in enumerate(zip(cache.layers, cache.profile.adapters, strict=True)):
        if adapter.has_state:
            if not adapter.has_state_refs:
                raise InconsistentStateError(f"layer {i}: a window state is not joined by row")
            # A row with no token before `length` has no state yet: `join_rows` gives it zeros (a fresh state).
            states = [adapter.state_refs(part.layers[i]) if pad < length else None for part, pad in parts]
            adapter.load_state(layer, join_rows(states, expand))
        if not adapter.has_kv:
            continue
        held = [(adapter.capture_kv(part.layers[i]) if pad < length else None, pad) for part, pad in parts]
        if not (cache.profile.expands or all(kv is None or kv[0].shape[-2] == length - pad for kv, pad in held)):
            raise InconsistentStateError(f"layer {i}: a row with states holds other positions than its keys would")
        template = next(kv for kv, _ in held if kv is not None)
        k = torch.cat([_behind_padding(kv[0] if kv else None, template[0], length, pad) for kv, pad in held])
        v = torch.cat([_behind_padding(kv[1] if kv else None, template[1], length, pad) for kv, pad in held])
        if expand > 1:
            k, v = k.repeat_interleave(expand, dim=0), v.repeat_interleave(expand, dim=0)
        adapter.restore_kv(layer, k, v, length)
    cache.count_linear(length)


def copy_row(cache: WorkingCache, row: int, start: int, end: int) -> WorkingCache:
    """A one-row cache holding copies of positions `[start, end)` of batch `row` (to store that row alone).

    Recurrent states summarise the whole row: they are copied as they are (the row's padding left
    them as they were before it, `joins_rows`), so `end` must be all the cache holds.
    """
    if not (cache.profile.expands or cache.profile.joins_rows):
        raise InconsistentStateError("these layers cannot be copied out by row")
    cache.land()
    out = WorkingCache(cache.profile)
    for layer, fresh, adapter in zip(cache.layers, out.layers, cache.profile.adapters, strict=True):
        if adapter.has_state_refs:
            adapter.load_state(fresh, select_row(adapter.state_refs(layer), row))
        kv = adapter.capture_kv(layer) if adapter.has_kv else None
        if kv is not None:
            k, v = (t[row : row + 1, :, start:end].clone() for t in kv)
            adapter.restore_kv(fresh, k, v, end - start)
    out.count_linear(end)
    return out


def trim(cache: WorkingCache, length: int, rows: Sequence[int]) -> None:
    """Keep positions `[0, length)` of batch `rows` in every attention layer (copies), for a cache
    that is only read afterwards (to store a prompt that beam search expanded).

    Where every layer keeps every position (`ModelProfile.expands`); with states, only to all the keys hold
    (copies of the kept rows, after assisted decoding cropped its rejected candidates): a state cannot go back.
    """
    if not cache.profile.expands and length != cache.kv_length():
        raise InconsistentStateError(
            f"a cache with states trims only to what its keys hold ({cache.kv_length()}), not {length}"
        )
    cache.land()
    index: torch.Tensor | None = None
    for layer, adapter in zip(cache.layers, cache.profile.adapters, strict=True):
        keys: torch.Tensor | None = getattr(layer, "keys", None)
        if adapter.is_trimmable and keys is not None:
            index = torch.tensor(list(rows), device=keys.device) if index is None else index
            adapter.trim(layer, length, index)


def _behind_padding(tensor: torch.Tensor | None, template: torch.Tensor, length: int, pad: int) -> torch.Tensor:
    """`[1, H, length, D]`: `tensor`'s first `length - pad` positions behind `pad` columns of zeros (a copy);
    all zeros, shaped like `template`, for a row that is padding only."""
    if tensor is None or pad >= length:
        return template.new_zeros((1, template.shape[1], length, template.shape[-1]))
    if tensor.shape[-2] < length - pad:
        raise InconsistentStateError(f"a row restored {tensor.shape[-2]} positions, {length - pad} wanted")
    return F.pad(tensor[..., : length - pad, :], (0, 0, pad, 0))
