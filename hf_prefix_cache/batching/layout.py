"""How the running batch's cache is laid out again when a row joins or rows leave, with as few copies as it can.

Where every layer keeps only per-token keys (`ModelProfile.expands`: full attention, sliding windows kept
at every position), a join writes the batch's rows and the new row behind their padding into one fresh
buffer per layer (one copy), and a departure keeps the rows left and drops the padding columns they all
share (one copy). Models with recurrent states (`ModelProfile.joins_rows`) take the store's own way
(`model.batch_rows`): every row copied out alone, then the rows restored side by side with their states
joined. Either way each row `i` holds its cache at columns `[pads[i], length)`, right-aligned, in a
`GrowingCache` (its full-attention layers then take each step's column in place). Where every cached layer
is plain full attention (`ModelProfile.defers_keys`), rows join and leave inside that cache's buffers
instead (`GrowingCache.add_row`, `drop_rows`): only the joining row, or the last row into a leaving row's
place, is copied.

Example:
    >>> from hf_prefix_cache.api.prefix_cache import store_of
    >>> profile = store_of(store).profile
    >>> with store.lookup(ids) as hit:
    ...     _ = model(ids, past_key_values=hit.cache, use_cache=True)
    >>> one = joined(profile, None, [], hit.cache, 36, 0)  # a batch of one row: 36 columns
    >>> two = joined(profile, one, [0], hit.cache, 30, 36)  # and a row of the first 30 positions, behind 6 pads
    >>> two.kv_length(), kept(profile, two, [0, 6], 36, [1], 30)[0].kv_length()  # the second row alone
    (36, 30)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from hf_prefix_cache.batching.growing import GrowingCache
from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.model import batch_rows
from hf_prefix_cache.model.working_cache import WorkingCache

if TYPE_CHECKING:
    from hf_prefix_cache.model.profile import ModelProfile


def joined(
    profile: ModelProfile, batch: WorkingCache | None, pads: Sequence[int], row: WorkingCache, row_len: int, length: int
) -> WorkingCache:
    """The batch cache of `batch`'s rows (behind `pads`, `length` columns wide before) then `row`'s `row_len`
    positions, all right-aligned to `max(length, row_len)` columns: `batch` itself where the rows join in place
    (`GrowingCache.lays_out_in_place`), else a new cache."""
    if (batch is None and profile.defers_keys) or (isinstance(batch, GrowingCache) and batch.lays_out_in_place()):
        out = batch if isinstance(batch, GrowingCache) else GrowingCache(profile)
        out.add_row(row, row_len)
        return out
    if not profile.expands:
        parts = [(batch_rows.copy_row(batch, i, pad, length), pad) for i, pad in enumerate(pads)] if batch else []
        width = max(length, row_len)
        out = GrowingCache(profile)
        laid = [(part, width - (length - pad)) for part, pad in parts] + [(row, width - row_len)]
        batch_rows.restore_rows(out, laid, width)
        return out
    width = max(length, row_len) if batch is not None else row_len
    row.land()
    if batch is not None:
        batch.land()
    out = GrowingCache(profile)
    for i, (fresh, adapter) in enumerate(zip(out.layers, profile.adapters, strict=True)):
        if not adapter.has_kv:
            continue
        new = adapter.capture_kv(row.layers[i])
        old = adapter.capture_kv(batch.layers[i]) if batch is not None else None
        if new is None or new[0].shape[-2] < row_len or (batch is not None and old is None):
            raise InconsistentStateError(f"layer {i}: a joining row holds no keys for its {row_len} positions")
        rows = len(pads) + 1
        tensors = []
        for j in range(2):
            template = new[j]
            buffer = template.new_zeros((rows, template.shape[1], width, template.shape[-1]))
            if old is not None:
                buffer[:-1, :, width - length :] = old[j]
            buffer[-1:, :, width - row_len :] = template[..., :row_len, :]
            tensors.append(buffer)
        adapter.restore_kv(fresh, tensors[0], tensors[1], width)
    out.count_linear(width)
    return out


def kept(
    profile: ModelProfile, batch: WorkingCache, pads: Sequence[int], length: int, rows: Sequence[int], width: int
) -> tuple[WorkingCache, list[int]]:
    """The batch cache of `batch`'s `rows` only (behind `pads`, `length` columns wide), cut to its last `width`
    columns (the padding columns every kept row shares are dropped), and the kept rows' indices in its order:
    `batch` itself where rows leave in place (a leaving row's place taken by the last row), else a new cache
    in the order of `rows`."""
    if isinstance(batch, GrowingCache) and batch.lays_out_in_place():
        staying = set(rows)
        order = batch.drop_rows([i for i in range(len(pads)) if i not in staying])
        batch.drop_columns(length - width)
        return batch, order
    if not profile.expands:
        parts = [(batch_rows.copy_row(batch, i, pads[i], length), width - (length - pads[i])) for i in rows]
        out = GrowingCache(profile)
        batch_rows.restore_rows(out, parts, width)
        return out, list(rows)
    batch.land()
    out = GrowingCache(profile)
    index: torch.Tensor | None = None
    for i, (layer, fresh, adapter) in enumerate(zip(batch.layers, out.layers, profile.adapters, strict=True)):
        if not adapter.has_kv:
            continue
        kv = adapter.capture_kv(layer)
        if kv is None:
            raise InconsistentStateError(f"layer {i}: the batch holds no keys")
        index = torch.tensor(list(rows), device=kv[0].device) if index is None else index
        k, v = (t[:, :, length - width :].index_select(0, index) for t in kv)
        adapter.restore_kv(fresh, k, v, width)
    out.count_linear(width)
    return out, list(rows)
