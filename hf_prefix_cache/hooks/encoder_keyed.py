"""What the encoder-decoder hooks share (`whisper.py`, `seq2seq.py`): keying by the encoder input.

An encoder-decoder model's decoder attends to the encoder output at every position, so its
self-attention states are only valid for the same encoder input. The hooks therefore:

1. hash the encoder input (`multimodal.media.hash_media`) and extend the model namespace by that
   hash (`open_request`): another input never shares decoder states, only the same one does;
2. reuse the encoder output stored for that hash (the store's `EncoderOutputs`, handed to the
   hook as `Serving.encoder_outputs`), passing it to `generate` as `encoder_outputs` so the
   encoder does not run (`keep_encoder_output` stores a new one);
3. where the decoder ids are known (inside `generate`), restore the matched decoder prefix into
   an `EncoderDecoderCache(working cache, empty cache)` (`restore_into`): transformers reuses a
   filled cross-attention part whatever the encoder output (`is_updated`), so it always starts
   empty and the first step projects this request's encoder output into it;
4. store each finished decoder row (`store_decoder_rows`).

A `DecoderRequest` carries what the outer call knows down to that inner call, through
the cache argument (`request_in` finds it there). Knows nothing about how a family builds its decoder ids.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from hf_prefix_cache import _compat
from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.hooks import pipeline
from hf_prefix_cache.hooks.checks import token_rows
from hf_prefix_cache.keys.namespace import sub_namespace
from hf_prefix_cache.keys.prefix_key import PrefixKey
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.store.contract import Fallback, FallbackRan, Lease, Served, Serving, Store
from hf_prefix_cache.store.sessions import Session

logger = logging.getLogger("hf_prefix_cache")


@dataclass(slots=True)
class DecoderRequest:
    """What an outer `generate` call hands the inner step that sees the decoder ids.

    `serving` is what the hook was handed with `store`. `namespace` is already extended by the
    encoder-input hash; `encoder_key` (the model's namespace and that hash) says where the input's
    encoder output is stored (`serving.encoder_outputs`). The inner step
    sets `served`, and `lease` / `working` when it restored a cache (`restore_into`), or
    `counted` when it served and stored the request itself (the outer call counts it).
    """

    store: Store
    serving: Serving
    namespace: str
    session: Session | None
    encoder_key: tuple[str, int]
    served: bool = field(default=False)
    lease: Lease | None = field(default=None)
    working: WorkingCache | None = field(default=None)
    counted: Served | None = field(default=None)  # to count when the call ends

    @property
    def key(self) -> PrefixKey:
        """The request's key with no symbols of its own: each decoder row it stores or restores brings them."""
        return PrefixKey(self.namespace, ())


R = TypeVar("R", bound=DecoderRequest)


def open_request(
    kind: type[R], store: Store, serving: Serving, digest: int, session: Session | None
) -> tuple[R, torch.Tensor | None]:
    """Key a request by its encoder input (hashed to `digest`): the request, and the encoder output stored for
    that input (None: not stored).

    Its decoder states live in the model's namespace extended by the hash: another input never shares them.
    """
    namespace = store.namespace()
    decoder_namespace = sub_namespace(namespace, "encoder_input", f"{digest:032x}")
    request = kind(store, serving, decoder_namespace, session, (namespace, digest))
    return request, serving.encoder_outputs.get(*request.encoder_key)


def keep_encoder_output(request: DecoderRequest, hidden: torch.Tensor) -> None:
    """Store the encoder output of the request's input (logged, not kept, when it alone exceeds the budget)."""
    if not request.serving.encoder_outputs.put(*request.encoder_key, hidden):
        logger.debug("encoder output of %d bytes exceeds max_encoder_bytes; not stored", hidden.nbytes)


def request_in(kind: type[R], store: Store, model_kwargs: dict[str, Any]) -> R | None:
    """The request of `store` that the cache argument in `model_kwargs` carries (None: not one of this store's;
    another store's hook may sit below)."""
    request = _compat.cache_in(model_kwargs)
    return request if isinstance(request, kind) and request.store is store else None


def restore_into(
    request: DecoderRequest, decoder_ids: torch.Tensor, model_kwargs: dict[str, Any], expand: int = 1
) -> bool:
    """Restore the stored prefix of the one-row `decoder_ids` and pass it as the cache in `model_kwargs`.

    The prefix fills `expand` rows: `generate` copies the decoder prompt that many times for beams or
    several returned sequences (after this step), and the encoder output with it.

    Sets the request's `lease` (release it when `generate` ends) and `working` cache (what to
    store afterwards). False when memory ran out or an exactness guard failed (`pipeline.Cold`): the
    request is counted cold and `model_kwargs` pass no cache.
    """
    store, rows = request.store, token_rows(decoder_ids)
    key, limit = request.key.with_symbols(rows[0]), len(rows[0]) - 1
    if len(rows) > 1:
        shared = pipeline.common_prefix_len(rows)  # rows of one decoder prompt (Whisper's copies), or what they share
        key, limit = key.prefix(shared), min(shared, limit)
    restored = pipeline.restore(store, request.serving.profile, key, len(rows) * expand, limit)
    if isinstance(restored, pipeline.Cold):
        _compat.pop_cache(model_kwargs)
        store.record(Fallback(restored.reason, len(rows[0]), log=False))
        store.record(FallbackRan(*restored))
        return False
    request.lease, request.working = restored
    # An empty cross-attention cache: the first step projects this request's encoder output into it.
    model_kwargs[request.working.profile.cache_kwarg] = EncoderDecoderCache(request.working, DynamicCache())
    return True


def store_decoder_rows(request: DecoderRequest, sequences: torch.Tensor, working: WorkingCache) -> None:
    """Store each decoder row of `sequences` with the states `working` holds for it (the session pins a lone row)."""
    keys = pipeline.sequence_keys(request.key, sequences, working.exact_length())
    batched = len(keys) > 1
    try:
        for row, key in enumerate(keys):
            request.store.insert_sequence(
                key, working, row=row if batched else None, session=None if batched else request.session
            )
    except InconsistentStateError as exc:  # the answer stands; what it would store failed a guard
        pipeline.not_stored(request.store, exc)
