"""Batches, left padding, beams and samples on models with recurrent states: rows prefilled alone, then joined.

A recurrent state has one snapshot per stored length, so rows cannot restore to one shared column
as attention keys do (`own_rows.py`): each distinct row restores its own prefix and is prefilled
to its last token, then the rows are laid side by side, each repeated for its beams or samples
(exact: masked left padding leaves a state as it was). Each prompt row is stored once prefilled;
greedy and sampled rows afterwards, a row that ended early up to its EOS (`EndStates`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.hooks import pipeline
from hf_prefix_cache.hooks.call import Call
from hf_prefix_cache.keys.prefix_key import PrefixKey
from hf_prefix_cache.model import batch_rows
from hf_prefix_cache.model.layers import LayerState
from hf_prefix_cache.model.layers.recurrent import select_row
from hf_prefix_cache.model.prefill import Prefill
from hf_prefix_cache.model.profile import ModelProfile
from hf_prefix_cache.model.states import Snapshot
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.store.contract import Lease, Served, Store
from hf_prefix_cache.token_ids import TokenIds

#: `generate`'s third positional parameter (after `inputs` and `generation_config`).
_LOGITS_PROCESSOR_POSITION = 2


@dataclass(slots=True)
class _Prefilled:
    """One distinct prompt row restored and prefilled alone: its lease, its one-row cache, how far it was fed."""

    lease: Lease
    cache: WorkingCache
    fed: int
    snapshots: list[Snapshot]


def restore(store: Store, prefill: Prefill, call: Call) -> pipeline.Held | pipeline.Cold:
    """Restore and prefill each distinct row alone, store each prompt as far as it was fed, and join the rows.

    Every distinct row's prefix is restored (and so pinned) before any row is stored, which could
    otherwise evict it under a byte budget. `Cold`, or `InconsistentStateError` from a prefill or the
    join, with nothing held. The held state: the rows as prefilled, the `EndStates` (or None).
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
            fed, snapshots = prefill.states(cache, ids, lease.cached_len, lease.matched_len)
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
    if call.eos and not (call.beams or call.assisted) and len(call.args) <= _LOGITS_PROCESSOR_POSITION:
        # A row that ends at EOS before the others is fed padding after it: its states at its EOS are kept (riding
        # after the caller's own logits processors, unless the caller passed those positionally).
        ends = EndStates(batch, call.eos, call.prompt_len)
        kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or ()), ends])
    return pipeline.Held([p.lease for p in prefilled.values()], batch, kwargs, (parts, ends))


def store_finished(store: Store, call: Call, held: pipeline.Held, output: Any) -> pipeline.Outcome:
    """Each returned row (the cache's rows: greedy or sampled) as its own entry; beams store nothing more (beam
    search reorders the rows; their prompts are stored already).

    Raises:
        InconsistentStateError: the batch's cache disagrees with its rows (an exactness guard).
    """
    parts, ends = held.state
    if not call.beams:
        sequences, kv_len = pipeline.sequences_of(output), held.cache.kv_length()
        length = kv_len if kv_len is not None else sequences.shape[1] - 1  # the last token is never fed back
        expanded = [row for row in call.rows for _ in range(call.expand)]
        computed = [p.lease.cached_len for p in parts for _ in range(call.expand)]
        pipeline.store_rows(
            store, expanded, sequences, held.cache, length, computed, ends.ends if ends is not None else None
        )
    reused = tuple((len(row.tokens), p.lease.cached_len) for row, p in zip(call.rows, parts, strict=True))
    return pipeline.Outcome(Served(call.prompt_len, call.prompt_len - 1, len(call.rows), rows=reused))


def _restored_again(
    store: Store, profile: ModelProfile, key: PrefixKey, held: tuple[Lease, WorkingCache]
) -> tuple[Lease, WorkingCache]:
    """`held` (a row's restored prefix), or a longer one where an earlier row of this call stored further along it
    (taken before the held one is given back; where it cannot be restored, the held one serves)."""
    if store.stored_len(key.namespace, key.symbols) <= held[0].cached_len:
        return held
    longer = pipeline.restore(store, profile, key)
    if isinstance(longer, pipeline.Cold):
        return held
    kept, dropped = (longer, held) if longer[0].cached_len > held[0].cached_len else (held, longer)
    store.release(dropped[0])
    return kept


def _store_prompt(store: Store, key: PrefixKey, part: _Prefilled) -> None:
    """A prompt row as far as it was fed, with its snapshots, from its one-row cache (the join copies it)."""
    if part.fed <= part.lease.cached_len:
        return  # nothing new: all of it was restored
    # The insert snapshots the cache's end itself; the prefill's snapshot there would be a second.
    earlier = [s for s in part.snapshots if s.length != part.fed]
    store.insert_sequence(key.prefix(part.fed), part.cache, earlier, computed_from=part.lease.cached_len)


class EndStates(LogitsProcessor):
    """A logits processor that changes no score: it keeps each row's recurrent states right after the row fed its
    first generated EOS, as `ends[row]`: the columns fed (its left padding included), its states by layer.

    `generate` feeds a row that ended padding until every row has, and calls a logits processor after
    each forward with the ids fed so far. Only where each forward feeds one position (no beams, no
    assisted decoding).

    >>> issubclass(EndStates, LogitsProcessor)
    True
    """

    def __init__(self, cache: WorkingCache, eos: frozenset[int], prompt_len: int) -> None:
        self._cache, self._eos, self._prompt_len = cache, eos, prompt_len
        self.ends: dict[int, tuple[int, dict[int, LayerState]]] = {}

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        fed, cache = int(input_ids.shape[1]), self._cache
        # Not the prompt's own forward (an EOS there ends no row), and one position per forward (else nothing is
        # kept: the row reuses less, never wrongly).
        if fed <= self._prompt_len or cache.kv_length() not in (None, fed):
            return scores
        for row, token in enumerate(input_ids[:, -1].tolist()):
            if token in self._eos and row not in self.ends:
                layers = enumerate(zip(cache.layers, cache.profile.adapters, strict=True))
                states = {i: select_row(a.state_refs(layer), row) for i, (layer, a) in layers if a.has_state_refs}
                self.ends[row] = (fed, states)
        return scores
