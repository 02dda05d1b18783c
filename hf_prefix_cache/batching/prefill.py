"""Chunked prefill: a row with many uncached prompt tokens is prefilled a piece per cycle, between the batch's steps.

A row admitted whole (`RunningBatch.admit`) holds every other row for its whole prefill: on two CPU
cores a cold 1,500-token SmolLM2 prompt stops the batch for about three seconds. A row whose prompt has more than
`chunk` tokens past its stored prefix (read from the store's tree, nothing restored: `wants_chunks`)
is prefilled here instead:

1. its stored prefix is restored and pinned (`PrefixCache.lookup`, under the row's salt);
2. each cycle of the loop feeds the model its next `chunk` prompt tokens (`advance`), then the batch
   steps once, so the rows in flight go on decoding between the pieces;
3. after the last piece the prompt is stored and counted as a `generate` call would count it
   (`Served`: the prompt's tokens, the restored ones), the prefix unpinned (`finish`), and the row joins
   the batch with the prompt's last logits (`RunningBatch.join`).

One row prefills in pieces at a time (the scheduler queues the others in arrival order): a row that starts
after another has stored its prompt restores it, so a burst of requests sharing an uncached system prompt
computes it once, as one at a time would; where that leaves a queued row `chunk` uncached tokens or fewer,
it is admitted whole. A row cancelled or past its deadline while it prefills keeps what it computed: the
prompt's fed part is stored (`abandon`). Only text rows of models whose every layer keeps per-token keys
(`ModelProfile.expands`: full attention and sliding windows, kept at every position in a working cache) are
chunked, as their caches grow by any number of positions exactly; recurrent and conv states prefill whole (the
store's snapshots of them are taken where `generate`'s prefill stops), as do rows with media. The pieces'
logits agree with one whole prefill's to the suite's float tolerance.

Example (`store` a fresh `PrefixCache` of a tiny Llama):
    >>> from hf_prefix_cache.batching.rows import Request, Row
    >>> row = Row(Request([5 + i % 50 for i in range(40)], max_new_tokens=2))
    >>> wants_chunks(store, row, 16)
    True
    >>> prefill = Prefill(store, row, 16)
    >>> [prefill.advance() is None for _ in range(3)]
    [True, True, False]
    >>> prefill.finish().kv_length(), store.stats().prompt_tokens
    (40, 40)
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from hf_prefix_cache.api.prefix_cache import store_of
from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.store.contract import Served

if TYPE_CHECKING:
    from hf_prefix_cache.api.prefix_cache import PrefixCache
    from hf_prefix_cache.batching.rows import EndReason, Row
    from hf_prefix_cache.model.working_cache import WorkingCache

logger = logging.getLogger("hf_prefix_cache")

#: Prompt tokens a cycle feeds a chunked row by default (``--prefill-chunk``; 0 prefills every row whole).
DEFAULT_CHUNK = 512


def wants_chunks(prefix_cache: PrefixCache, row: Row, chunk: int) -> bool:
    """Whether `row` is prefilled in pieces of `chunk` tokens: a text row of a model whose every layer keeps per-token
    keys (`ModelProfile.expands`) and whose prompt has more than `chunk` tokens past its stored prefix (under its
    salt)."""
    store = store_of(prefix_cache)
    profile, request = store.profile, row.request
    if chunk <= 0 or len(request.ids) <= chunk or not profile.expands or profile.media is not None:
        return False
    if request.inputs:
        return False
    with prefix_cache.request(request.salt):  # the namespace of the row's salt; counts nothing
        namespace = store.namespace()
    return len(request.ids) - store.stored_len(namespace, request.ids) > chunk


class Prefill:
    """One row's prompt prefilled `chunk` tokens at a time on its own restored cache (see the module).

    Args:
        prefix_cache: the store (the row's prefix is restored from it, its prompt stored back).
        row: the row; its `scope` is made here, as `RunningBatch.admit` makes it.
        chunk: prompt tokens fed per `advance`.
    """

    def __init__(self, prefix_cache: PrefixCache, row: Row, chunk: int) -> None:
        if chunk < 1:
            raise ValueError(f"a prefill chunk is at least one token, got {chunk}")
        store = store_of(prefix_cache)
        self.row = row
        self._front, self._store, self._chunk = prefix_cache, store, chunk
        row.scope = prefix_cache.request(row.request.salt)
        with row.scope:
            self._lookup = prefix_cache.lookup(list(row.request.ids))
        self.cache: WorkingCache = self._lookup.cache
        self.cached_len = self.fed = self._lookup.cached_len

    def advance(self) -> torch.Tensor | None:
        """Feed the next `chunk` prompt tokens; the prompt's last `[vocab]` logits once all are fed, else None."""
        ids = self.row.request.ids
        start, end = self.fed, min(self.fed + self._chunk, len(ids))
        model, profile = self._store.model, self._store.profile
        device = model.device
        kwargs: dict[str, Any] = {
            profile.cache_kwarg: self.cache,
            "position_ids": torch.arange(start, end, device=device)[None],
            "use_cache": True,
        }
        if profile.accepts_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids[start:end]], device=device), **kwargs).logits[0, -1]
        self.fed = end
        return logits if end == len(ids) else None

    def finish(self) -> WorkingCache:
        """Store the whole prompt under the row's salt, count it as one served call, unpin the prefix; the cache."""
        row, ids = self.row, self.row.request.ids
        try:
            with row.scope:  # type: ignore[union-attr]  # set in __init__
                self._store.record(Served(len(ids), self.cached_len))
                self._front.insert(ids, self.cache)
        except (ValueError, InconsistentStateError) as exc:  # its answer stands; only its reuse is lost
            logger.warning("batching: a prompt prefilled in pieces was not stored: %s", exc)
        finally:
            self._lookup.release()
        logger.info("prefix cache: reused %d of %d prompt tokens (prefilled in pieces)", self.cached_len, len(ids))
        return self.cache

    def abandon(self, reason: EndReason, error: BaseException | None = None) -> None:
        """End the row for `reason` before its prompt is all fed: the fed part is stored (unless an error ended it),
        the prefix unpinned."""
        row = self.row
        try:
            if error is None and self.fed > self.cached_len:
                with row.scope:  # type: ignore[union-attr]  # set in __init__
                    self._front.insert(row.request.ids[: self.fed], self.cache)
        except ValueError as exc:
            logger.warning("batching: a prefill's fed part was not stored: %s", exc)
        finally:
            self._lookup.release()
            row.finish(reason, error)
