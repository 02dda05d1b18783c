"""What the encoder-decoder hooks share (`whisper.py`, `seq2seq.py`): keying by the encoder input.

An encoder-decoder model's decoder attends to the encoder output at every position, so its
self-attention states are only valid for the same encoder input. The hooks therefore:

1. hash the encoder input (`multimodal.media.hash_media`) and extend the model namespace by that
   hash (`encoder_namespace`): another input never shares decoder states, only the same one does;
2. reuse the encoder output stored for that hash (`storage.encoder_outputs.EncoderOutputs`),
   passing it to `generate` as `encoder_outputs` so the encoder does not run (`keep_encoder_output`
   stores a new one);
3. where the decoder ids are known (inside `generate`), restore the matched decoder prefix into
   an `EncoderDecoderCache(working cache, empty cache)` (`restore_decoder`): transformers reuses a
   filled cross-attention part whatever the encoder output (`is_updated`), so it always starts
   empty and the first step projects this request's encoder output into it.

A `DecoderRequest` carries what the outer call knows down to that inner call, through
the cache argument. Knows nothing about how a family builds its decoder ids.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from hf_prefix_cache.integration import pipeline
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.store.contract import Lease, Store
from hf_prefix_cache.store.sessions import Session

logger = logging.getLogger("hf_prefix_cache")


@dataclass(slots=True)
class DecoderRequest:
    """What an outer `generate` call hands the inner step that sees the decoder ids.

    `namespace` is already extended by the encoder-input hash. The inner step sets `served`,
    and `lease` / `working` when it restored a cache (the outer call releases and stores them), or
    `counted` when it served and stored the request itself (the outer call counts it).
    """

    store: Store
    namespace: str
    session: Session | None
    served: bool = field(default=False)
    lease: Lease | None = field(default=None)
    working: WorkingCache | None = field(default=None)
    counted: tuple[int, int] | None = field(default=None)  # (prompt_len, restore_len) to count when the call ends


def encoder_namespace(store: Store, namespace: str, digest: int) -> str:
    """The store's tree namespace of decoder states computed over the encoder input hashed to `digest`."""
    return store.sub_namespace(namespace, "encoder_input", f"{digest:032x}")


def keep_encoder_output(store: Store, namespace: str, digest: int, hidden: torch.Tensor) -> None:
    """Store the encoder output of input `digest` (logged, not kept, when it alone exceeds the budget)."""
    if not store.encoder_outputs.put(namespace, digest, hidden):
        logger.debug("encoder output of %d bytes exceeds max_encoder_bytes; not stored", hidden.nbytes)


def restore_decoder(
    store: Store, namespace: str, decoder_ids: torch.Tensor
) -> tuple[Lease, WorkingCache, EncoderDecoderCache] | None:
    """A lease on the stored prefix of the one-row `decoder_ids`, restored; None when out of memory.

    Returns the lease (release it when `generate` ends), the working self-attention cache
    (what to store afterwards) and the `EncoderDecoderCache` to hand `generate`.
    """
    rows = decoder_ids.tolist()
    restored = pipeline.restore(store, namespace, rows, rows[0])
    if restored is None:
        return None
    lease, working = restored
    # An empty cross-attention cache: the first step projects this request's encoder output into it.
    return lease, working, EncoderDecoderCache(working, DynamicCache())
