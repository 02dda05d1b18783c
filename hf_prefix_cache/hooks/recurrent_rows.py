"""Batches, left padding, beams and samples on models with recurrent states: rows prefilled alone, then joined.

A recurrent state has one snapshot per stored prefix length, so the rows of a batch cannot
restore to one shared column the way attention keys do (`pipeline.restore_rows`). Instead each
distinct prompt row runs as a one-row call would: it restores its own longest stored prefix and
prefills the rest of its prompt but the last token (`recurrent_prefill.py`), snapshotting as
usual. The rows are then laid side by side (`batch_rows.restore_rows`): keys behind each row's
left padding, states as they are, each row repeated for its beams or returned sequences.
`generate` gets the caller's ids and mask unchanged and feeds the last column itself.

Exact because masked left padding leaves a recurrent layer's state as it was: transformers'
Mamba, Mamba-2, gated-delta-net and short-conv layers zero the inputs of masked positions (the
state after the padding is the fresh one), and positions follow the mask where the model takes
them. A padded row of a cold batch equals the same row alone to 1e-6 on every hybrid and
recurrent family tested (`tests/hooks/test_decoding_modes_hybrid.py` checks each mode
against the cold call).

Each prompt row is stored as far as it was prefilled as soon as it was (from the one-row cache
it was prefilled in), so the rows after it restore from its snapshots: a batch of questions
after a shared system prompt, stored with another question and so without a snapshot at the
prompt's end, computes that prompt once, in its first row. Afterwards, sampled and greedy rows
are stored one entry each (copied out row by row); a row that ended at EOS before the others (and
was fed padding after it) up to and with its EOS, with the states it had then (`end_states.py`).
Beams store nothing more, since beam search reorders the rows every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.hooks import pipeline
from hf_prefix_cache.hooks.call import Call, Row
from hf_prefix_cache.hooks.checks import token_rows
from hf_prefix_cache.hooks.end_states import EndStates, ride_along
from hf_prefix_cache.hooks.recurrent_prefill import prefill_states
from hf_prefix_cache.keys.prefix_key import PrefixKey
from hf_prefix_cache.model import batch_rows
from hf_prefix_cache.model.layers import LayerState
from hf_prefix_cache.model.profile import ModelProfile
from hf_prefix_cache.model.states import Snapshot
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.store.contract import Lease, Served, Store
from hf_prefix_cache.token_ids import TokenIds


@dataclass(frozen=True, slots=True)
class Prefill:
    """How the hook prefills a recurrent model's prompt (`recurrent_prefill.prefill_states`): the model, its profile,
    the store's snapshot interval, and whether tokens go one per forward once a state exists."""

    model: Any
    profile: ModelProfile
    snapshot_interval: int | None
    one_token_steps: bool


@dataclass(slots=True)
class _Prefilled:
    """One distinct prompt row restored and prefilled alone: its lease, its one-row cache, how far it was fed."""

    lease: Lease
    cache: WorkingCache
    fed: int
    snapshots: list[Snapshot]


class _Joined(NamedTuple):
    """What the store step needs of a state-rows call: each distinct row as prefilled, and the states of the rows
    that fed their EOS before the batch ended (None where nothing watched for it)."""

    parts: list[_Prefilled]
    ends: EndStates | None


def restore(store: Store, prefill: Prefill, call: Call) -> pipeline.Held | pipeline.Cold:
    """Restore and prefill each distinct row alone, store each prompt as far as it was fed, and join the rows.

    Every distinct row's prefix is restored (and so pinned) before any row is stored: a row stored
    early under a byte budget could otherwise evict what a later row was about to restore. `Cold`
    (nothing held) when a row's restore runs out of memory twice or fails a guard; a guard that fails
    in a prefill or the join raises `InconsistentStateError`, with nothing held.
    """
    profile = prefill.profile
    prefilled: dict[TokenIds, _Prefilled] = {}
    held: dict[TokenIds, tuple[Lease, WorkingCache]] = {}
    try:
        for row in call.rows:
            if row.tokens not in held:
                restored = pipeline.restore(store, profile, row.key)
                if isinstance(restored, pipeline.Cold):
                    pipeline.release_all(store, [lease for lease, _ in held.values()])
                    held.clear()
                    return restored
                held[row.tokens] = restored
        for i, row in enumerate(call.rows):
            if row.tokens in prefilled:
                continue  # identical rows restore and prefill once
            if prefilled:  # an earlier row of this call was stored: it may have left a snapshot further along this one
                held[row.tokens] = _restored_again(store, profile, row.key, held[row.tokens])
            lease, cache = held[row.tokens]
            ids = call.input_ids[i : i + 1, row.pad :]
            # Up to the last token always (not only where `prompt_snapshot` says): every row must reach one column.
            fed, snapshots = prefill_states(
                prefill.model,
                profile,
                cache,
                ids,
                lease,
                prefill.snapshot_interval,
                prefill.one_token_steps,
                None,
                prompt_end=True,
            )
            if fed != ids.shape[1] - 1:
                raise InconsistentStateError(f"a row of {ids.shape[1]} tokens prefilled to {fed}")
            prefilled[row.tokens] = _Prefilled(lease, cache, fed, snapshots)
            del held[row.tokens]  # its lease is the prefilled row's now
            # Stored now, so that the next rows restore from its snapshots: where it left the stored prefix
            # (a shared system prompt stored with another question has no snapshot at its end), and its end.
            _store_prompt(store, row.key, prefilled[row.tokens])
        parts = [prefilled[row.tokens] for row in call.rows]
        length = call.prompt_len - 1  # every row fed up to the last column
        batch = WorkingCache(profile)
        if length:
            batch_rows.restore_rows(
                batch, [(p.cache, row.pad) for p, row in zip(parts, call.rows, strict=True)], length, call.expand
            )
    except BaseException:
        pipeline.release_all(store, [p.lease for p in prefilled.values()] + [lease for lease, _ in held.values()])
        raise
    if not profile.prompt_sliced:
        batch.skip_len = length
    kwargs = pipeline.generate_kwargs(call, profile, batch)
    ends: EndStates | None = None
    if call.eos and not (call.beams or call.assisted):
        # A row that ends at EOS before the others is fed padding after it: its states at its EOS are kept.
        ends = EndStates(batch, call.eos, call.prompt_len)
        if not ride_along(kwargs, call.args, ends):
            ends = None
    return pipeline.Held([p.lease for p in prefilled.values()], batch, kwargs, _Joined(parts, ends))


def store_finished(store: Store, call: Call, held: pipeline.Held, output: Any) -> pipeline.Outcome:
    """Each returned row (the cache's rows: greedy or sampled) as its own entry; beams store nothing more (their
    prompts are stored already, and beam search reorders the rows every step).

    Raises:
        InconsistentStateError: the batch's cache disagrees with its rows (an exactness guard).
    """
    parts, ends = held.state
    if not call.beams:
        # The cache's rows, greedy or sampled, without their padding; the prompts and their snapshots are stored
        # already (`_store_prompt`).
        sequences, kv_len = pipeline.sequences_of(output), held.cache.kv_length()
        length = kv_len if kv_len is not None else sequences.shape[1] - 1  # the last token is never fed back
        expanded = [row for row in call.rows for _ in range(call.expand)]
        computed = [p.lease.cached_len for p in parts for _ in range(call.expand)]
        _store_rows(store, expanded, sequences, held.cache, length, computed, ends.ends if ends is not None else {})
    reused = tuple((len(row.tokens), p.lease.cached_len) for row, p in zip(call.rows, parts, strict=True))
    return pipeline.Outcome(Served(call.prompt_len, call.prompt_len - 1, len(call.rows), rows=reused))


def _store_rows(
    store: Store,
    rows: list[Row],
    sequences: torch.Tensor,
    cache: WorkingCache,
    length: int,
    computed_from: list[int],
    ends: dict[int, tuple[int, dict[int, LayerState]]],
) -> None:
    """Each finished row as its own entry: its first `length` ids with the batch's final states, or, for a row that
    fed its EOS before that (and padding after it), its ids up to and with its EOS, with the states it had then
    (`EndStates`)."""
    for i, ids in enumerate(token_rows(sequences[:, :length])):
        pad, end, states = rows[i].pad, length, None
        if i in ends:
            end, states = ends[i]
            if end > length:
                raise InconsistentStateError(f"row {i}'s EOS states at {end} columns, past the {length} fed")
        if end <= pad:
            continue
        part = batch_rows.copy_row(cache, i, pad, end)
        if states is not None:
            for j, state in states.items():
                part.profile.adapters[j].load_state(part.layers[j], state)
        store.insert_sequence(rows[i].key.with_symbols(ids[pad:end]), part, computed_from=computed_from[i])


def _restored_again(
    store: Store, profile: ModelProfile, key: PrefixKey, held: tuple[Lease, WorkingCache]
) -> tuple[Lease, WorkingCache]:
    """`held` (a row's restored prefix), or a longer one where an earlier row of this call stored further along it.

    The longer lease is taken before the held one is given back, so the held prefix stays pinned until then; if
    memory runs out for the longer one, the held one serves.
    """
    lease, _ = held
    if store.stored_len(key.namespace, key.symbols) <= lease.cached_len:
        return held
    longer = pipeline.restore(store, profile, key)
    if isinstance(longer, pipeline.Cold) or longer[0].cached_len <= lease.cached_len:
        if not isinstance(longer, pipeline.Cold):
            store.release(longer[0])
        return held
    store.release(lease)
    return longer


def _store_prompt(store: Store, key: PrefixKey, part: _Prefilled) -> None:
    """A prompt row as far as it was fed, with its snapshots, from its one-row cache (the join copies it)."""
    if part.fed <= part.lease.cached_len:
        return  # nothing new: all of it was restored
    # The insert snapshots the cache's end itself; the prefill's snapshot there would be a second.
    earlier = [s for s in part.snapshots if s.length != part.fed]
    store.insert_sequence(key.prefix(part.fed), part.cache, earlier, computed_from=part.lease.cached_len)
