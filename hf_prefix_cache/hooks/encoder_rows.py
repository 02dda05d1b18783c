"""Encoder rows: a batch of encoder inputs (BART, T5, ...), each row restored and stored under its own input.

The encoder-keyed restore/store pair for a batch (`encoder_keyed.py` serves one input). Each row
of the batch is keyed by the hash of its own encoder input (its ids and mask, padding included:
`DecoderRequest.namespaces`) and restores the longest decoder prefix stored under it. A decoder
prompt has no padding (a decoder mask with zeros runs cold), so the batch restores to the column
every row reaches, the shortest restored prefix (`batch_rows.restore_rows`), each row repeated for
its beams or returned sequences; `generate` then feeds every row from that column. Each finished
row is stored as its own entry under its own input (copied out row by row); after beam search,
each row's decoder prompt once. The encoder outputs are the stored ones of every row, stacked,
where every row's is stored; otherwise `generate` runs the encoder on the batch, as a cold call
does, and each row's output is stored (`encoder_keyed.keep_encoder_output`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hf_prefix_cache import reasons
from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.hooks import pipeline
from hf_prefix_cache.hooks.call import Row
from hf_prefix_cache.hooks.checks import token_rows
from hf_prefix_cache.model import batch_rows
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.storage.mover import is_out_of_memory
from hf_prefix_cache.store.contract import Served
from hf_prefix_cache.token_ids import TokenIds

if TYPE_CHECKING:
    from hf_prefix_cache.hooks.encoder_keyed import DecoderRequest


def land_rows(request: DecoderRequest, rows: list[TokenIds]) -> WorkingCache:
    """Each decoder prompt row's stored prefix under its own encoder input, joined into one cache at the column every
    row reaches (`request.restored_len`); the request holds every lease.

    Raises:
        pipeline.RunCold: memory ran out (twice for a row's restore), or a row's restore failed a guard.
        InconsistentStateError: the decoder rows are not one per encoder row.
    """
    per_input = len(rows) // len(request.namespaces)  # Whisper's copies of each clip's prompt for several sequences
    if per_input * len(request.namespaces) != len(rows):
        raise InconsistentStateError(f"{len(rows)} decoder rows for {len(request.namespaces)} encoder rows")
    store, profile = request.store, request.serving.profile
    parts: list[tuple[WorkingCache, int]] = []
    for i, row in enumerate(rows):
        restored = pipeline.restore(store, profile, request.key(i // per_input).with_symbols(row))
        if isinstance(restored, pipeline.Cold):
            raise pipeline.RunCold(restored, request.prompt_len)
        lease, part = restored
        request.leases.append(lease)
        part.land()  # pieces restored layer by layer at first use land now: they are read here, not by the model
        parts.append((part, 0))  # no padding in a decoder prompt
    length = min(lease.cached_len for lease in request.leases)
    cache = WorkingCache(profile)
    if length:
        try:
            batch_rows.restore_rows(cache, parts, length, request.expand)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            raise pipeline.RunCold(pipeline.Cold(reasons.OUT_OF_MEMORY), request.prompt_len) from exc
    request.restored_len = length
    return cache


def store_rows(request: DecoderRequest, sequences: torch.Tensor, working: WorkingCache) -> pipeline.Outcome:
    """Each row of `sequences` (each input's rows, in order; after beam search, the decoder prompt rows) stored as
    its own entry under its encoder input; the batch as served, row by row.

    Raises:
        InconsistentStateError: the cache holds no per-token keys to store rows from.
    """
    prompts = request.decoder_ids
    if prompts is None:
        raise InconsistentStateError("generate ended without reaching the step that restores the decoder prefix")
    num_inputs, length = len(request.namespaces), request.restored_len
    if request.beams:
        batch_rows.trim(working, request.prompt_len, range(0, len(prompts) * request.expand, request.expand))
    kv_len = working.exact_length()
    if kv_len is None:
        raise InconsistentStateError("rows are stored from layers of per-token keys")
    tokens = token_rows(prompts)
    per_input, per_prompt = len(sequences) // num_inputs, len(sequences) // len(prompts)
    rows = [Row(tokens[i // per_prompt], 0, request.key(i // per_input)) for i in range(len(sequences))]
    pipeline.store_rows(request.store, rows, sequences, working, kv_len, [length] * len(rows))
    reduced = (reasons.BATCH_LAYOUT,) if any(lease.cached_len > length for lease in request.leases) else ()
    by_row = ((request.prompt_len, length),) * num_inputs
    return pipeline.Outcome(Served(request.prompt_len, length, num_inputs, rows=by_row), reduced)
