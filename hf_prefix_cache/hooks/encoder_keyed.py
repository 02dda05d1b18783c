"""Encoder-keyed calls (`whisper.py`, `seq2seq.py`): the call as a value, and its restore and store steps.

An encoder-decoder model's decoder attends to the encoder output at every position, so its states
are valid only for the same encoder input: the namespace is extended by the input's hash, and the
encoder output stored for it is passed as `encoder_outputs` (`EncoderKeyedHook._restore`). The
decoder ids are known only inside `generate`: the family's inner step finds its `DecoderRequest`
in the cache argument (`request_in`) and completes the restore there (`land`) into an
`EncoderDecoderCache(working cache, empty cache)` (transformers reuses a filled cross-attention
part whatever the encoder output), or raises `pipeline.RunCold`. A batch restores each row under
its own input to the column every row reaches (`_land_rows`) and stores each under its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from hf_prefix_cache import _compat, reasons
from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.hooks import pipeline, refusals
from hf_prefix_cache.hooks.call import Row
from hf_prefix_cache.hooks.patching import PatchingHook
from hf_prefix_cache.keys.namespace import sub_namespace
from hf_prefix_cache.keys.prefix_key import PrefixKey
from hf_prefix_cache.model import batch_rows
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.storage.mover import is_out_of_memory
from hf_prefix_cache.store.contract import Lease, Served, Serving, Store
from hf_prefix_cache.store.sessions import Session
from hf_prefix_cache.token_ids import TokenIds

logger = logging.getLogger("hf_prefix_cache")


@dataclass(frozen=True, slots=True)
class EncoderCall:
    """One encoder-decoder `generate` call as a value: its arguments by name (`kwargs`; `args` stays empty), the
    decoder prompt length a cold run counts (`prompt_len`), its session, and the hash of what feeds its encoder in
    each row (`digests`: one, or a batch's, each row served under its own)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    prompt_len: int
    session: Session | None
    digests: tuple[int, ...]


@dataclass(slots=True)
class DecoderRequest:
    """One encoder-keyed request while it runs: made by the restore step, completed by the family's inner step.

    `namespaces`: the model's extended by each row's encoder-input hash; `encoder_keys`: where each
    input's encoder output is stored; `kwargs`: what `generate` runs with (this request as its cache).
    `land` sets the decoder prompt, its rows (`expand`, `beams`), the `leases`, the `working` cache and
    a batch's column (`restored_len`); `finished` holds Whisper's rows, `reset` a cold rerun's RNG state.
    """

    store: Store
    serving: Serving
    namespaces: tuple[str, ...]
    session: Session | None
    encoder_keys: tuple[tuple[str, int], ...]
    kwargs: dict[str, Any]
    keep_encoder: bool = False  # a miss: the inner step keeps the encoder output generate computed
    landed: bool = False
    leases: list[Lease] = field(default_factory=list)
    working: WorkingCache | None = None
    decoder_ids: torch.Tensor | None = None
    prompt_len: int = 0
    restored_len: int = 0
    expand: int = 1  # rows generate makes of each decoder prompt row: beams or several sequences
    beams: bool = False  # beam search: the returned rows are not the cache's rows
    finished: Any = None
    reset: Callable[[], None] | None = None

    def key(self, row: int = 0) -> PrefixKey:
        """The key of encoder row `row`, with no symbols of its own: each decoder row it stores or restores brings
        them."""
        return PrefixKey(self.namespaces[row], ())


class EncoderKeyedHook(PatchingHook):
    """The hook of an encoder-decoder family: the call read once (`_read`), then `pipeline.serve`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """One `generate` call: read it (`_read`), then the request path (`pipeline.serve`), or a cold run."""
        ours, session = pipeline.claim(self._store, self._model, kwargs, self._serving.serves_uncached)
        if not ours:
            return self._original(*args, **kwargs)
        call, reason = self._read(self._arguments(args, kwargs), session)
        if reason is not None:
            return pipeline.run_cold(self._store, self._original, reason, call.prompt_len, args, kwargs)
        return pipeline.serve(self._store, self._generate, call, self._restore, self._store_finished)

    def _read(self, arguments: dict[str, Any], session: Session | None) -> tuple[EncoderCall, str | None]:
        """The call as a value (its arguments by name), and why it cannot reuse safely (None: it can): the model
        unsupported, a refused argument, the family's own `_problem`, or an encoder input that cannot be hashed."""
        reason = (
            self._profile.unsupported
            or refusals.refused_argument(arguments, encoder_keyed=True)
            or self._problem(arguments)
        )
        digests = self._digests(arguments) if reason is None else None
        if digests is None:
            reason = reason or reasons.UNHASHABLE_MEDIA
        return EncoderCall((), arguments, self._cold_len(arguments), session, digests or ()), reason

    # ----------------------------------------------------------------- the family's part
    def _problem(self, arguments: dict[str, Any]) -> str | None:
        """The family's reason this call (its arguments by name) cannot reuse safely, or None."""
        raise NotImplementedError

    def _digests(self, arguments: dict[str, Any]) -> tuple[int, ...] | None:
        """The hash of what feeds the encoder, row by row (None: unhashable)."""
        raise NotImplementedError

    def _cold_len(self, arguments: dict[str, Any]) -> int:
        """The prompt length a cold run of this call counts."""
        return 0

    def _arm(self, call: EncoderCall, request: DecoderRequest, hidden: torch.Tensor | None) -> None:
        """Edit `request.kwargs` for `generate`: the stored encoder output `hidden` in place of the encoder (None: not
        stored; `generate` computes it, or the family does and keeps it)."""
        raise NotImplementedError

    def _rows(self, request: DecoderRequest, output: Any) -> torch.Tensor | None:
        """The finished decoder rows to store (None: they disagree with the cache; nothing is stored)."""
        return pipeline.sequences_of(output)

    def _generate(self, *args: Any, **kwargs: Any) -> Any:
        """The `generate` the request path runs (served or cold)."""
        return self._original(*args, **kwargs)

    # ----------------------------------------------------------------- restore and store steps
    def _restore(self, call: EncoderCall) -> DecoderRequest:
        """The request of these encoder inputs, their stored encoder outputs (where every row's is stored) in place of
        the encoder; its decoder prefix is restored inside `generate` (`land`)."""
        namespace = self._store.namespace()
        request = DecoderRequest(
            self._store,
            self._serving,
            tuple(sub_namespace(namespace, "encoder_input", f"{digest:032x}") for digest in call.digests),
            call.session,
            tuple((namespace, digest) for digest in call.digests),
            dict(call.kwargs),
        )
        request.kwargs[self._profile.cache_kwarg] = request
        stored = [self._serving.encoder_outputs.get(*key) for key in request.encoder_keys]
        hidden = None if any(h is None for h in stored) else torch.cat([h for h in stored if h is not None])
        self._arm(call, request, hidden)
        return request

    def _store_finished(self, call: EncoderCall, request: DecoderRequest, output: Any) -> pipeline.Outcome:
        """Each finished decoder row stored (after beam search, the decoder prompt once, as `decoder_only.py` stores
        beams); the request as served.

        Raises:
            InconsistentStateError: `generate` never completed the restore, or the cache disagrees with a row.
        """
        working, ids = request.working, request.decoder_ids
        if working is None or ids is None or not request.leases:
            raise InconsistentStateError("generate ended without reaching the step that restores the decoder prefix")
        sequences = ids if request.beams else self._rows(request, output)
        if len(request.namespaces) > 1 and sequences is not None:
            return _store_rows(request, sequences, working)
        lease = request.leases[0]
        served = pipeline.Outcome(Served(request.prompt_len, lease.cached_len))
        kv_len = working.kv_length()
        if kv_len is not None and kv_len <= lease.matched_len and request.session is None:
            return served  # an exact repeat: the request added nothing to what it matched (and marked used)
        if request.beams:
            batch_rows.trim(working, request.prompt_len, [0])
            sequences = ids[:1]
        if sequences is None:
            logger.warning("decoder rows do not match their cache (%s positions); not stored", kv_len)
            return served
        keys = pipeline.sequence_keys(request.key(), sequences, working.exact_length())
        batched = len(keys) > 1  # the session pins a lone row
        for row, key in enumerate(keys):
            request.store.insert_sequence(
                key, working, row=row if batched else None, session=None if batched else request.session
            )
        return served


def request_in(store: Store, model_kwargs: dict[str, Any]) -> DecoderRequest | None:
    """The request of `store` that the cache argument in `model_kwargs` carries (None: not one of this store's;
    another store's hook may sit below)."""
    request = _compat.cache_in(model_kwargs)
    return request if isinstance(request, DecoderRequest) and request.store is store else None


def keep_encoder_output(request: DecoderRequest, hidden: torch.Tensor) -> None:
    """Store the encoder output of each of the request's inputs (logged, not kept, when it alone exceeds the budget):
    a batch's row by row, each copied out of the batch's output (a view would hold all of it)."""
    keys = request.encoder_keys
    for i, key in enumerate(keys):
        row = hidden if len(keys) == 1 else hidden[i : i + 1].clone()
        if not request.serving.encoder_outputs.put(*key, row):
            logger.debug("encoder output of %d bytes exceeds max_encoder_bytes; not stored", row.nbytes)


def land(request: DecoderRequest, decoder_ids: torch.Tensor, model_kwargs: dict[str, Any]) -> None:
    """The restore step's end, inside `generate`: the stored prefix of `decoder_ids` restored into `request.expand`
    rows of each (`generate` copies them after this step), passed as the cache in `model_kwargs`. Rows of one
    decoder prompt (Whisper's copies) restore what they share; a batch's rows each their own (`_land_rows`).

    Raises:
        pipeline.RunCold: memory ran out twice, or an exactness guard failed (the call runs cold).
    """
    store, rows = request.store, pipeline.token_rows(decoder_ids)
    request.landed, request.decoder_ids, request.prompt_len = True, decoder_ids, len(rows[0])
    if len(request.namespaces) > 1:
        request.working = _land_rows(request, rows)
    else:
        key, limit = request.key().with_symbols(rows[0]), len(rows[0]) - 1
        if len(rows) > 1:
            shared = pipeline.common_prefix_len(rows)
            key, limit = key.prefix(shared), min(shared, limit)
        restored = pipeline.restore(store, request.serving.profile, key, len(rows) * request.expand, limit)
        if isinstance(restored, pipeline.Cold):
            raise pipeline.RunCold(restored, request.prompt_len)
        lease, request.working = restored
        request.leases.append(lease)
    # An empty cross-attention cache: the first step projects this request's encoder output into it.
    model_kwargs[request.working.profile.cache_kwarg] = EncoderDecoderCache(request.working, DynamicCache())


def _land_rows(request: DecoderRequest, rows: list[TokenIds]) -> WorkingCache:
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


def _store_rows(request: DecoderRequest, sequences: torch.Tensor, working: WorkingCache) -> pipeline.Outcome:
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
    tokens = pipeline.token_rows(prompts)
    per_input, per_prompt = len(sequences) // num_inputs, len(sequences) // len(prompts)
    rows = [Row(tokens[i // per_prompt], 0, request.key(i // per_input)) for i in range(len(sequences))]
    pipeline.store_rows(request.store, rows, sequences, working, kv_len, [length] * len(rows))
    reduced = (reasons.BATCH_LAYOUT,) if any(lease.cached_len > length for lease in request.leases) else ()
    by_row = ((request.prompt_len, length),) * num_inputs
    return pipeline.Outcome(Served(request.prompt_len, length, num_inputs, rows=by_row), reduced)
