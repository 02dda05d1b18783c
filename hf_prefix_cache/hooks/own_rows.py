"""Own rows (`Mode.OWN_ROWS`): a batch of distinct or left-padded rows of per-token keys, each restoring its own prefix.

The batch restores to the column every row reaches (its padding plus its stored prefix), each row
repeated for its beams or returned sequences (`batch_rows.restore_rows`); `generate` gets the
caller's ids and mask unchanged, so positions, masks and outputs are the cold call's. On a static
cache the batch is copied into its buffers and back out after `generate` (`model/static.py`).
Each finished row is stored as its own entry without its padding; after beam search, each row's
prompt once.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import StaticCache

from hf_prefix_cache import reasons
from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.hooks import pipeline
from hf_prefix_cache.hooks.call import Call
from hf_prefix_cache.model import batch_rows
from hf_prefix_cache.model.profile import ModelProfile
from hf_prefix_cache.model.static import from_static, to_static
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.storage.mover import is_out_of_memory
from hf_prefix_cache.store.contract import Lease, Served, Store

logger = logging.getLogger("hf_prefix_cache")


def restore(store: Store, profile: ModelProfile, config: Any, call: Call) -> pipeline.Held | pipeline.Cold:
    """Leases on each row's own longest stored prefix, restored into one batch behind its left padding (and copied
    into a static cache of `call.static_len` positions for the model's `config` where the call asks for one).

    `pipeline.Cold` when memory ran out twice (the store moves its unpinned entries off the device after the
    first out-of-memory error) or a guard failed; nothing stays pinned then. The held state is the
    column `length` the batch restored to, and the static cache (or None).
    """
    pads = call.pads
    for attempt in range(2):
        leases: list[Lease] = []
        try:
            parts = []
            for row in call.rows:
                part = WorkingCache(profile)
                leases.append(store.acquire(row.key, part, limit=len(row.key.symbols) - 1))
                parts.append(part)
            # A row that restored nothing bounds the batch by its padding alone.
            length = min(pad + lease.cached_len for pad, lease in zip(pads, leases, strict=True))
            if not any(lease.cached_len and pad < length for pad, lease in zip(pads, leases, strict=True)):
                length = 0  # no row brings keys below that column: nothing to restore
            cache = WorkingCache(profile)
            if length:
                batch_rows.restore_rows(cache, list(zip(parts, pads, strict=True)), length, call.expand)
            break
        except Exception as exc:
            pipeline.release_all(store, leases)
            if isinstance(exc, InconsistentStateError):
                return pipeline.guard_failed(exc)
            if not is_out_of_memory(exc):
                raise
            logger.warning("out of memory restoring cached prefixes (attempt %d): %s", attempt + 1, exc)
    else:
        return pipeline.Cold(reasons.OUT_OF_MEMORY)
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
