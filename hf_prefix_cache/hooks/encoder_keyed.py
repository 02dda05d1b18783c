"""Encoder-keyed calls (`whisper.py`, `seq2seq.py`): the call as a value, and its restore and store steps.

A decoder's states are valid only for the same encoder input: the namespace is extended by the
input's hash, and the encoder output stored for it is passed as `encoder_outputs`. The decoder ids
are known only inside `generate`: the family's inner step finds its `DecoderRequest` in the cache
argument (`request_in`) and completes the restore there (`land`) into an
`EncoderDecoderCache(working cache, empty cache)`, or raises `pipeline.RunCold`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from hf_prefix_cache import _compat, reasons
from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.hooks import own_rows, pipeline, refusals
from hf_prefix_cache.hooks.call import Row
from hf_prefix_cache.hooks.checks import GenerationSettings
from hf_prefix_cache.hooks.patching import PatchingHook
from hf_prefix_cache.keys.namespace import sub_namespace
from hf_prefix_cache.keys.prefix_key import PrefixKey
from hf_prefix_cache.model import batch_rows
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.store.contract import Lease, Served, Serving, Store
from hf_prefix_cache.store.sessions import Session

logger = logging.getLogger("hf_prefix_cache")


@dataclass(frozen=True, slots=True)
class EncoderCall:
    """One encoder-decoder `generate` call as a value: its arguments by name (`kwargs`; no `args`), the decoder prompt
    length a cold run counts, its session, and the hash of what feeds its encoder in each row (`digests`)."""

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
    `land` sets the rest; `finished` holds Whisper's rows, `reset` a cold rerun's RNG state.
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
        """The key of encoder row `row`, with no symbols: each decoder row it stores or restores brings them."""
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
        """The call as a value, and why it cannot reuse safely (None: it can): the model unsupported, a refused
        argument, the family's own `_problem`, or an encoder input that cannot be hashed."""
        reason = self._profile.unsupported or refusals.refused_argument(arguments, True) or self._problem(arguments)
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
        """Edit `request.kwargs` for `generate`: the stored encoder output `hidden` (None: none) for the encoder."""
        raise NotImplementedError

    def _decoding_problem(self, settings: GenerationSettings, served: frozenset[str]) -> str | None:
        """Decoding settings or a cache implementation (other than those `served`) a hit could not reproduce."""
        modes = refusals.Modes(expands=self._profile.expands)
        return refusals.decoding_problem(settings, modes) or refusals.cache_implementation_problem(settings, served)

    def _rows(self, request: DecoderRequest, output: Any) -> torch.Tensor | None:
        """The finished decoder rows to store (None: they disagree with the cache; nothing is stored)."""
        return pipeline.sequences_of(output)

    def _generate(self, *args: Any, **kwargs: Any) -> Any:
        """The `generate` the request path runs (served or cold)."""
        return self._original(*args, **kwargs)

    # ----------------------------------------------------------------- restore and store steps
    def _restore(self, call: EncoderCall) -> DecoderRequest:
        """The request of these encoder inputs, with their stored encoder outputs (where every row's is stored); its
        decoder prefix is restored inside `generate` (`land`)."""
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
        """Each finished decoder row stored (after beam search, the decoder prompt once); the request as served.

        Raises:
            InconsistentStateError: `generate` never completed the restore, or the cache disagrees with a row.
        """
        working, ids = request.working, request.decoder_ids
        if working is None or ids is None or not request.leases:
            raise InconsistentStateError("generate ended without reaching the step that restores the decoder prefix")
        sequences = ids if request.beams else self._rows(request, output)
        if len(request.namespaces) > 1 and sequences is not None:
            return _store_rows(request, ids, sequences, working)
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
        pipeline.store_sequences(request.store, request.key(), sequences, working, request.session)
        return served


def request_in(store: Store, model_kwargs: dict[str, Any]) -> DecoderRequest | None:
    """The request of `store` in the cache argument of `model_kwargs` (None: not this store's; another's may be)."""
    request = _compat.cache_in(model_kwargs)
    return request if isinstance(request, DecoderRequest) and request.store is store else None


def keep_encoder_output(request: DecoderRequest, hidden: torch.Tensor) -> None:
    """Store the encoder output of each of the request's inputs (not kept when it alone exceeds the budget), a batch's
    row by row, each copied out (a view would hold all of it)."""
    keys = request.encoder_keys
    for i, key in enumerate(keys):
        row = hidden if len(keys) == 1 else hidden[i : i + 1].clone()
        if not request.serving.encoder_outputs.put(*key, row):
            logger.debug("encoder output of %d bytes exceeds max_encoder_bytes; not stored", row.nbytes)


def land(request: DecoderRequest, decoder_ids: torch.Tensor, model_kwargs: dict[str, Any]) -> None:
    """The restore step's end, inside `generate`: the stored prefix of `decoder_ids` restored into `request.expand`
    rows of each (`generate` copies them after this step), passed as the cache in `model_kwargs`. Rows of one
    decoder prompt (Whisper's copies) restore what they share; a batch's rows each their own under its encoder
    input, joined at the column every row reaches (`own_rows.restore_rows`, `request.restored_len`).

    Raises:
        pipeline.RunCold: memory ran out, or an exactness guard failed (the call runs cold).
        InconsistentStateError: a batch's decoder rows are not one per encoder row.
    """
    store, profile, rows = request.store, request.serving.profile, pipeline.token_rows(decoder_ids)
    request.landed, request.decoder_ids, request.prompt_len = True, decoder_ids, len(rows[0])
    num_inputs = len(request.namespaces)
    if num_inputs > 1:
        per_input = len(rows) // num_inputs  # Whisper's copies of each clip's prompt for several sequences
        if per_input * num_inputs != len(rows):
            raise InconsistentStateError(f"{len(rows)} decoder rows for {num_inputs} encoder rows")
        keys = [(request.key(i // per_input).with_symbols(row), 0) for i, row in enumerate(rows)]  # no padding
        joined = own_rows.restore_rows(store, profile, keys, request.expand)
        if isinstance(joined, pipeline.Cold):
            raise pipeline.RunCold(joined, request.prompt_len)
        leases, request.working, request.restored_len = joined
    else:
        key, limit = request.key().with_symbols(rows[0]), len(rows[0]) - 1
        if len(rows) > 1:
            shared = _common_prefix_len(rows)
            key, limit = key.prefix(shared), min(shared, limit)
        restored = pipeline.restore(store, profile, key, len(rows) * request.expand, limit)
        if isinstance(restored, pipeline.Cold):
            raise pipeline.RunCold(restored, request.prompt_len)
        leases, request.working = [restored[0]], restored[1]
    request.leases.extend(leases)
    # An empty cross-attention cache: the first step projects this request's encoder output into it.
    model_kwargs[profile.cache_kwarg] = EncoderDecoderCache(request.working, DynamicCache())


def _common_prefix_len(rows: Sequence[Sequence[int]]) -> int:
    """How many leading ids every row shares.

    >>> _common_prefix_len([[1, 2, 3], [1, 2, 4], [1, 5, 3]])
    1
    """
    first = rows[0]
    n = len(first)
    for row in rows[1:]:
        n = next((i for i, (a, b) in enumerate(zip(first[:n], row, strict=False)) if a != b), n)
    return n


def _store_rows(
    request: DecoderRequest, prompts: torch.Tensor, sequences: torch.Tensor, working: WorkingCache
) -> pipeline.Outcome:
    """Each row of `sequences` (each input's rows, in order; after beam search, the decoder `prompts`) stored as its
    own entry under its encoder input; the batch as served, row by row.

    Raises:
        InconsistentStateError: the cache holds no per-token keys to store rows from.
    """
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
