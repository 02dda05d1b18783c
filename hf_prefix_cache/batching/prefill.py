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
prompt's fed part is stored (`abandon`). Every text row of a model the batch takes is chunked (`eligibility.py`):
full attention and sliding windows, kept at every position in a working cache, and the hybrids' recurrent and
conv states, which continue exactly over a piece. A recurrent state restores only where it was snapshotted, so
those rows also cut a piece where `generate`'s prefill through the store would snapshot (`model/prefill.py`: the
divergence from the stored prefix, every `snapshot_interval` tokens, before the prompt's last token) and store
those snapshots with the prompt: what a later request restores is the same either way. `wants_chunks` counts the
uncached tokens from the stored match, which for recurrent states may reach past the last snapshot: such a row can
be admitted whole with more than `chunk` tokens to feed. Rows with media prefill whole. The pieces' logits agree
with one whole prefill's to the suite's float tolerance.

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
from typing import TYPE_CHECKING

import torch

from hf_prefix_cache.api.prefix_cache import serving_of, store_of
from hf_prefix_cache.batching.eligibility import model_alone_reason
from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.keys.prefix_key import PrefixKey
from hf_prefix_cache.model.prefill import Prefill as PromptPrefill
from hf_prefix_cache.model.prefill import feed
from hf_prefix_cache.store.contract import Served

if TYPE_CHECKING:
    from hf_prefix_cache.api.prefix_cache import PrefixCache
    from hf_prefix_cache.batching.rows import EndReason, Row
    from hf_prefix_cache.model.states import Snapshot
    from hf_prefix_cache.model.working_cache import WorkingCache

logger = logging.getLogger("hf_prefix_cache")

#: Prompt tokens a cycle feeds a chunked row by default (``--prefill-chunk``; 0 prefills every row whole).
DEFAULT_CHUNK = 512


def wants_chunks(prefix_cache: PrefixCache, row: Row, chunk: int) -> bool:
    """Whether `row` is prefilled in pieces of `chunk` tokens: a text row of a model the batch takes, whose prompt has
    more than `chunk` tokens past its stored prefix (under its salt)."""
    store = store_of(prefix_cache)
    profile, request = store.profile, row.request
    if chunk <= 0 or len(request.ids) <= chunk or profile.media is not None or model_alone_reason(profile):
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
        self._ids = torch.tensor([list(row.request.ids)], device=store.model.device)
        # A model with recurrent or conv states snapshots where `generate`'s prefill through the store would stop
        # (`model/prefill.py`): at the divergence from the stored prefix, every snapshot interval and, with
        # `prompt_snapshot`, before the prompt's last token; a piece is cut there for the snapshot.
        self.snapshots: list[Snapshot] = []
        self._snapshot_at: list[int] = []
        n = len(row.request.ids)
        if store.profile.has_state and n - 1 > self.cached_len:
            serving = serving_of(prefix_cache)
            plan = PromptPrefill(store.model, store.profile, serving.snapshot_interval, one_token_steps=False)
            matched = self._lookup.matched_len
            self._snapshot_at = plan.bounds(self.cached_len, n - 1, matched, keep_end=serving.prompt_snapshot)

    def advance(self) -> torch.Tensor | None:
        """Feed the next `chunk` prompt tokens; the prompt's last `[vocab]` logits once all are fed, else None."""
        n = len(self.row.request.ids)
        start, end = self.fed, min(self.fed + self._chunk, n)
        for bound in self._snapshot_at:
            if start < bound <= end and bound < n:
                self._forward(start, bound)
                self.snapshots.append(self.cache.snapshot(bound))
                start = bound
        logits = self._forward(start, end) if start < end else None
        self.fed = end
        return logits if end == n else None

    def finish(self) -> WorkingCache:
        """Store the whole prompt under the row's salt, count it as one served call, unpin the prefix; the cache."""
        row, ids = self.row, self.row.request.ids
        try:
            with row.scope:  # type: ignore[union-attr]  # set in __init__
                self._store.record(Served(len(ids), self.cached_len))
                self._insert(len(ids))
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
                    self._insert(self.fed)
        except (ValueError, InconsistentStateError) as exc:
            logger.warning("batching: a prefill's fed part was not stored: %s", exc)
        finally:
            self._lookup.release()
            row.finish(reason, error)

    def _forward(self, start: int, end: int) -> torch.Tensor:
        """Feed prompt positions `[start, end)`; their last `[vocab]` logits."""
        with torch.no_grad():
            return feed(self._store.model, self._store.profile, self.cache, self._ids, start, end)

    def _insert(self, length: int) -> None:
        """Store the prompt's first `length` tokens (all the cache holds) and the snapshots taken before them, in the
        namespace of the scope that is open (the row's salt); what the restore gave is not checked again."""
        ids = list(self.row.request.ids[:length])
        if self.cache.kv_length() not in (None, length):
            raise InconsistentStateError(f"the cache holds {self.cache.kv_length()} positions, not {length}")
        key = PrefixKey(self._store.namespace(), ids)
        snapshots = [s for s in self.snapshots if s.length < length]  # the insert snapshots the end itself
        self._store.insert_sequence(key, self.cache, snapshots, computed_from=self.cached_len)
