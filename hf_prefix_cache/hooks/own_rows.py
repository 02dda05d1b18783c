"""Own rows (`Mode.OWN_ROWS`): a batch of distinct or left-padded rows of per-token keys, each restoring its own prefix.

Each row restores alone, joined at the column every row reaches (`restore_rows`, which encoder-keyed
batches use too); `generate` gets the caller's ids and mask unchanged, so the outputs are the cold
call's. A static cache gets the batch copied in and back out (`model/static.py`). Each finished row
is stored as its own entry without its padding; after beam search, each row's prompt once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from transformers import StaticCache

from hf_prefix_cache import reasons
from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.hooks import pipeline
from hf_prefix_cache.hooks.call import Call
from hf_prefix_cache.keys.prefix_key import PrefixKey
from hf_prefix_cache.model import batch_rows
from hf_prefix_cache.model.profile import ModelProfile
from hf_prefix_cache.model.static import from_static, to_static
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.storage.mover import is_out_of_memory
from hf_prefix_cache.store.contract import Lease, Served, Store

logger = logging.getLogger("hf_prefix_cache")


def restore(store: Store, profile: ModelProfile, config: Any, call: Call) -> pipeline.Held | pipeline.Cold:
    """Each row's own longest stored prefix restored into one batch (`restore_rows`), copied into a static cache for
    the model's `config` where the call asks for one. The held state: the batch's column, the static cache or None.
    """
    restored = restore_rows(store, profile, [(row.key, row.pad) for row in call.rows], call.expand)
    if isinstance(restored, pipeline.Cold):
        return restored
    leases, cache, length = restored
    static: StaticCache | None = None
    if call.static_len:
        try:
            static = to_static(cache, config, call.static_len)  # the rows as laid out, padding columns included
        except BaseException:
            pipeline.release_all(store, leases)
            raise
    kwargs = pipeline.generate_kwargs(call, profile, cache if static is None else static)
    if call.assisted:
        cache.skip_len = length
    cache.prompt_len = call.prompt_len  # which indexer rows are the prompt's (`model/indexer_ties.py`)
    return pipeline.Held(leases, cache, kwargs, (length, static))


def restore_rows(
    store: Store, profile: ModelProfile, rows: Sequence[tuple[PrefixKey, int]], expand: int = 1
) -> tuple[list[Lease], WorkingCache, int] | pipeline.Cold:
    """Each row's own prefix (`rows`: its key and left padding) restored alone, joined behind its padding into one
    fresh cache at the column every row reaches, each row `expand` times: the leases, the cache and that column.
    `Cold` (nothing left pinned) as `pipeline.restore` gives it, or when the join runs out of memory or fails a guard.
    """
    leases: list[Lease] = []
    try:
        parts: list[tuple[WorkingCache, int]] = []
        for key, pad in rows:
            restored = pipeline.restore(store, profile, key)
            if isinstance(restored, pipeline.Cold):
                pipeline.release_all(store, leases)
                return restored
            leases.append(restored[0])
            restored[1].land()  # pieces restored layer by layer at first use land now: the join reads them
            parts.append((restored[1], pad))
        # A row that restored nothing bounds the batch by its padding alone.
        length = min(pad + lease.cached_len for (_, pad), lease in zip(parts, leases, strict=True))
        if not any(lease.cached_len and pad < length for (_, pad), lease in zip(parts, leases, strict=True)):
            length = 0  # no row brings keys below that column: nothing to restore
        cache = WorkingCache(profile)
        if length:
            batch_rows.restore_rows(cache, parts, length, expand)
    except BaseException as exc:
        pipeline.release_all(store, leases)
        if isinstance(exc, InconsistentStateError):
            return pipeline.guard_failed(exc)
        if not is_out_of_memory(exc):
            raise
        logger.warning("out of memory joining restored rows: %s", exc)
        return pipeline.Cold(reasons.OUT_OF_MEMORY)
    return leases, cache, length


def store_finished(store: Store, call: Call, held: pipeline.Held, output: Any) -> pipeline.Outcome:
    """Each finished row stored as its own entry (after beam search, each row's prompt once from its first beam).

    Raises:
        InconsistentStateError: the cache disagrees with a finished row (an exactness guard).
    """
    cache, (length, static) = held.cache, held.state
    reused = [max(length - pad, 0) for pad in call.pads]
    served = Served(
        call.prompt_len,
        length,
        len(call.rows),
        rows=tuple((len(row.tokens), used) for row, used in zip(call.rows, reused, strict=True)),
    )
    reduced = []
    if any(lease.cached_len > used for lease, used in zip(held.leases, reused, strict=True)):
        reduced.append(reasons.BATCH_LAYOUT)  # a row had more stored than the shared column allows
    if static is not None:
        copied = from_static(static, cache)  # the buffers are this call's: copy what to store out
        if copied is None:  # a sliding layer wrote past its window: the earliest positions are gone
            return pipeline.Outcome(served, (*reduced, reasons.STATIC_WINDOW))
        cache = copied
    rows, sequences, computed = call.rows, call.input_ids, reused
    if call.beams:
        # As for a shared prompt's beams: the prompt of each row, from the first of its beams.
        batch_rows.trim(cache, call.prompt_len, range(0, len(call.rows) * call.expand, call.expand))
    else:
        rows = tuple(row for row in call.rows for _ in range(call.expand))
        sequences, computed = pipeline.sequences_of(output), [max(length - row.pad, 0) for row in rows]
    kv_len = cache.exact_length()  # all the cache holds, unless an indexer tied (`model/indexer_ties.py`)
    if kv_len is None:
        raise InconsistentStateError("rows are stored from layers of per-token keys")
    pipeline.store_rows(store, rows, sequences, cache, kv_len, computed)
    if cache.tied_at is not None:
        reduced.append(reasons.INDEXER_TIE)  # stored only up to the tie (`exact_length`)
    return pipeline.Outcome(served, tuple(reduced))
