"""DecoderOnlyHook: `generate` of decoder-only models (text, media, recurrent) on a restored prefix.

A call with the store as its cache is read as a value with its mode (`checks.read_call`) and runs
the request path (`pipeline.serve`) with the mode's steps: one prompt here, rows of their own in
`own_rows.py`, rows with recurrent states in `recurrent_rows.py`. `generate` always receives the
full prompt ids (streamers, logits processors and sequences are a cold run's) and feeds the model
only the uncached suffix and its media; recurrent states are prefilled first (`model/prefill.py`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from hf_prefix_cache import _compat, reasons
from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.hooks import media as media_prompts
from hf_prefix_cache.hooks import own_rows, pipeline, recurrent_rows
from hf_prefix_cache.hooks.call import Call, Mode, capabilities
from hf_prefix_cache.hooks.checks import read_call
from hf_prefix_cache.hooks.patching import DECODER_ONLY, Family, InstancePatch, PatchingHook, register
from hf_prefix_cache.hooks.refusals import serving_modes
from hf_prefix_cache.model import batch_rows
from hf_prefix_cache.model.indexer_ties import TieWatch
from hf_prefix_cache.model.module_states import ModuleStateBridge
from hf_prefix_cache.model.prefill import Prefill
from hf_prefix_cache.model.scan import ScanContinuation
from hf_prefix_cache.model.states import ItemState, Snapshot
from hf_prefix_cache.model.static import from_static, to_static
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.store.contract import Served, Serving, Store

logger = logging.getLogger("hf_prefix_cache")


class DecoderOnlyHook(PatchingHook):
    """Installs itself as `model.generate`; `detach` puts the original back."""

    def __init__(self, store: Store, model: Any, serving: Serving) -> None:
        super().__init__(store, model, serving)
        profile = serving.profile
        self._capabilities = capabilities(profile)  # what the mode table reads of the model (`call.py`)
        if profile.unsupported is not None:
            return  # every call runs cold (`checks.py`): nothing to patch or prefill, which the model may not even have
        if not profile.prompt_sliced:
            self._keep(_skip_cached_ids(model, slice_mask=True, cache_kwarg=profile.cache_kwarg))
        elif serving_modes(profile).assisted:
            # Assisted decoding feeds its first forward the whole prompt, whatever the cache holds.
            self._keep(_skip_cached_ids(model, slice_mask=False))
        # Recurrence kept in module attributes (RecurrentGemma) is kept in the working cache's layers instead.
        bridge = self._keep(ModuleStateBridge.install(model, WorkingCache))
        scan = None
        if profile.single_token_steps and bridge is None:
            scan = self._keep(ScanContinuation.install(model, lambda cache: isinstance(cache, WorkingCache)))
            if scan is None:
                name = type(model).__name__
                logger.warning("%s: cannot continue its selective scan; resumed prompts are fed token by token", name)
        # One forward per token once a state exists (only when the scan cannot be continued exactly).
        self._prefill = Prefill(model, profile, serving.snapshot_interval, profile.single_token_steps and scan is None)
        if profile.media is not None and media_prompts.expands_media(model):
            # Beams and several sequences: the suffix's encoded media copied whole to each row.
            self._keep(media_prompts.expand_suffix_media(model))
        if profile.watch_indexers:
            # Sparse-attention indexers: a tie at the top-k boundary stops reuse (`model/indexer_ties.py`).
            self._keep(TieWatch.install(model, WorkingCache))

    # ----------------------------------------------------------------- request
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """One `generate` call: check and key it (`read_call`), then its mode's request path (`pipeline.serve`)."""
        store = self._store
        ours, session = pipeline.claim(store, self._model, kwargs, self._serving.serves_uncached)
        if not ours:
            return self._original(*args, **kwargs)
        arguments = self._arguments(args, kwargs)
        call, reason, prompt_len = read_call(
            store, self._model, self._profile, self._signature, self._capabilities, arguments, args, kwargs, session
        )
        if call is None:
            return pipeline.run_cold(store, self._original, reason, prompt_len, args, kwargs)
        restore_step: pipeline.RestoreStep
        store_step: pipeline.StoreStep
        if call.mode is Mode.STATE_ROWS:
            restore_step = functools.partial(recurrent_rows.restore, store, self._prefill)
            store_step = functools.partial(recurrent_rows.store_finished, store)
        elif call.mode is Mode.OWN_ROWS:
            restore_step = functools.partial(own_rows.restore, store, self._profile, self._model.config)
            store_step = functools.partial(own_rows.store_finished, store)
        else:  # one prompt (`Mode.SHARED`, `Mode.STATIC`)
            restore_step, store_step = self._restore_shared, self._store_shared
        return pipeline.serve(store, self._original, call, restore_step, store_step)

    def _restore_shared(self, call: Call) -> pipeline.Held | pipeline.Cold:
        """Restore one prompt's prefix into every row, prefill recurrent states, and make `generate`'s kwargs."""
        store, profile, media = self._store, self._profile, self._profile.media
        restored = pipeline.restore(store, profile, call.rows[0].key, len(call.rows) * call.expand)
        if isinstance(restored, pipeline.Cold):
            return restored
        lease, cache = restored
        try:
            if call.scope and lease.matched_len == 0 and call.layout is not None:
                media_prompts.count_new_media(store, profile, call.base_namespace, call.layout)
            snapshots: list[Snapshot] = []
            fed = lease.cached_len
            cache.prompt_len = call.prompt_len  # which indexer rows are the prompt's (`model/indexer_ties.py`)
            if profile.has_state and not (call.assisted and profile.has_recurrence):
                # The uncached prompt fed in chunks, snapshotting where wanted. Not for assisted decoding on recurrence:
                # its cold run's first forward takes the whole prompt, so generate feeds all the cache lacks.
                fed, snapshots = self._prefill.states(
                    cache,
                    call.input_ids,
                    lease.cached_len,
                    lease.matched_len,
                    media_prompts.suffix_embeds(profile, call.input_ids, call.kwargs, call.layout, lease.cached_len),
                    call.rows[0].key.spans,
                    self._serving.prompt_snapshot,
                    media.prefill_positions(call.input_ids, call.kwargs) if media is not None else None,
                )
            if not profile.prompt_sliced or call.assisted:
                cache.skip_len = fed
            kwargs = call.kwargs
            if media is not None and call.layout is not None and fed:
                # Only the media of what the cache lacks go to generate (plus explicit positions for M-RoPE).
                kwargs = media.resume_kwargs(call.input_ids, kwargs, call.layout, fed)
            static = None
            if call.mode is Mode.STATIC:
                # The prefix copied into preallocated buffers, as generate would allocate them (`model/static.py`).
                static = to_static(cache, self._model.config, call.static_len)
            kwargs = pipeline.generate_kwargs(call, profile, cache if static is None else static, kwargs)
        except BaseException:
            store.release(lease)
            raise
        return pipeline.Held((lease,), cache, kwargs, (lease, snapshots, static))

    def _store_shared(self, call: Call, held: pipeline.Held, output: Any) -> pipeline.Outcome:
        """Store each finished row (a beam search's prompt, once) with its states and its media item states.

        Raises:
            InconsistentStateError: the cache disagrees with the finished sequence (an exactness guard).
        """
        (lease, snapshots, static), cache, key, store = held.state, held.cache, call.rows[0].key, self._store
        if static is not None:
            copied = from_static(static, cache)  # the buffers are this call's: copy what to store out
            if copied is None:  # a sliding layer wrote past its window: the earliest positions are gone
                return pipeline.Outcome(Served(call.prompt_len, lease.cached_len), (reasons.STATIC_WINDOW,))
            cache = copied
        items: list[ItemState] = []
        if key.item_spans:
            # The cross-attention layers now hold every image; the restored ones are stored already.
            items = cache.capture_items([end for _, end in key.item_spans], lease.num_items)
        kv_len = cache.kv_length()
        repeat = kv_len is not None and kv_len <= lease.matched_len and not self._profile.has_state
        if not repeat or items or call.session:  # an exact repeat adds nothing to what it matched (and marked used)
            sequences = pipeline.sequences_of(output)
            if call.beams:
                # The finished beams are not the cache's rows (reordered every step, ended at different steps), but
                # every row holds the same prompt: store the prompt once per row, from its first beam.
                batch_rows.trim(cache, call.prompt_len, range(0, len(call.rows) * call.expand, call.expand))
                sequences = call.input_ids
            elif call.assisted:
                # Rejected candidates were cropped off as views: copy out what is kept, so no bytes hang on.
                if kv_len is None:  # assisted decoding on a model without attention keys is refused before this
                    raise InconsistentStateError("an assisted call's cache holds no keys to store")
                batch_rows.trim(cache, kv_len, range(len(call.rows)))
            # As far as the cache holds exactly: all of it, unless an indexer tied (`model/indexer_ties.py`).
            pipeline.store_sequences(store, key, sequences, cache, call.session, lease.cached_len, snapshots, items)
        logger.debug("matched %d tokens, restored %d, namespace %s", lease.matched_len, lease.cached_len, key.namespace)
        reduced = []
        layout = call.layout
        lost = media_prompts.media_padding_loss(store, key, layout, lease) if layout and layout.items else None
        if lost is not None:
            reduced.append(reasons.MEDIA_PADDING)  # reuse stopped at a medium stored with other padding
        if cache.tied_at is not None:
            reduced.append(reasons.INDEXER_TIE)  # stored only up to the tie (`exact_length`)
        # Media symbols split the hit by modality; a prompt without media is all text (no scan).
        has_media = layout is not None and bool(layout.items)
        served = Served(call.prompt_len, lease.cached_len, len(call.rows), key.symbols if has_media else None)
        return pipeline.Outcome(served, tuple(reduced))


def _skip_cached_ids(model: Any, slice_mask: bool, cache_kwarg: str | None = None) -> InstancePatch:
    """Skip what the working cache holds where `generate` does not slice the prompt by the cache (with the mask:
    `slice_mask`), and in the first forward of assisted decoding. `cache_kwarg`: a model's own (RWKV's `state`)."""

    def prepare_inputs_for_generation(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        cache = _compat.cache_in(kwargs)
        if cache is None and cache_kwarg is not None:
            cache = kwargs.get(cache_kwarg)
        if isinstance(cache, WorkingCache) and cache.skip_len:
            skip, cache.skip_len = cache.skip_len, None
            kwargs["next_sequence_length"] = input_ids.shape[1] - skip
            mask = kwargs.get("attention_mask")
            if mask is not None and slice_mask:
                kwargs["attention_mask"] = mask[:, skip:]
        return patch.original(input_ids, *args, **kwargs)

    patch = InstancePatch(model, "prepare_inputs_for_generation", prepare_inputs_for_generation)
    return patch


register(Family(DECODER_ONLY, DecoderOnlyHook))
