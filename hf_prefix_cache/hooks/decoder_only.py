"""DecoderOnlyHook: `generate` of decoder-only models (text, media, recurrent) on a restored prefix.

Wraps one model's `generate` so that `model.generate(..., cache=store)` (or `past_key_values=store`) runs the
pipeline (`pipeline.py`): check the call, key it, restore, generate, store. `generate` always
receives the full prompt ids (so streamers, logits processors and the returned sequences are
as in a cold run); transformers then feeds the model only the uncached suffix. Requests that
cannot reuse safely run the original `generate` untouched, and the reason is counted.

Prompts with media (models with a `MediaAdapter`) are keyed by tokens and media content
together; `generate` then gets only the media of the uncached suffix, and M-RoPE models get
explicit positions of the whole prompt. Cross-attention models (Mllama) also restore the
vision keys/values of the prefix's images (item states) and store those of new images.
Recurrent models prefill their uncached prompt in snapshot-sized chunks first
(`recurrent_prefill.py`); with media (families whose adapter computes suffix embeddings,
LFM2-VL), fed the embeddings the model would compute, so `generate` then gets no media at all.
Their batches, left-padded rows, beams and samples prefill each row alone and join the rows
(`recurrent_rows.py`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import StaticCache

from hf_prefix_cache import _compat, reasons
from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.hooks import pipeline, recurrent_rows
from hf_prefix_cache.hooks.checks import CACHE_IMPLEMENTATION, check_call, media_layout, serving_modes
from hf_prefix_cache.hooks.media_expansion import expand_suffix_media, expands_media
from hf_prefix_cache.hooks.media_padding import count_media_padding
from hf_prefix_cache.hooks.patching import InstancePatch, PatchingHook
from hf_prefix_cache.hooks.recurrent_prefill import prefill_states
from hf_prefix_cache.hooks.registry import DECODER_ONLY, Family, register
from hf_prefix_cache.hooks.scan import ScanContinuation
from hf_prefix_cache.keys.namespace import sub_namespace
from hf_prefix_cache.keys.prefix_key import PrefixKey
from hf_prefix_cache.model.indexer_ties import IndexerTie, TieWatch
from hf_prefix_cache.model.module_states import ModuleStateBridge
from hf_prefix_cache.model.profile import ModelProfile
from hf_prefix_cache.model.states import ItemState, Snapshot
from hf_prefix_cache.model.static import from_static, to_static
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.multimodal.media import MediaLayout
from hf_prefix_cache.store.contract import Lease, ReducedReuse, Served, Serving, Store
from hf_prefix_cache.store.sessions import Session
from hf_prefix_cache.token_ids import TokenIds

logger = logging.getLogger("hf_prefix_cache")


@dataclass(slots=True)
class _Call:
    """One `generate` call as the steps see it: what it passed, then what checking and keying found."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    input_ids: Any
    prompt_len: int
    session: Session | None
    rows: list[TokenIds] = field(default_factory=list)  # each row's tokens after its left padding
    pads: tuple[int, ...] = ()  # each row's left padding
    drop_impl: bool = False  # drop the call's cache_implementation: the working cache serves it
    expand: int = 1  # rows generate makes of each prompt row (beams, several returned sequences)
    beams: bool = False  # beam search: the returned rows are not the cache's rows
    assisted: bool = False  # assisted or prompt-lookup decoding: its first forward is fed the whole prompt
    static_len: int = 0  # cache_implementation="static": the positions of the static cache (0: not static)
    static: StaticCache | None = None  # the static cache generate ran on, to copy out afterwards
    layout: MediaLayout | None = None
    key: PrefixKey = PrefixKey("", ())  # the first row's key (`_key`); the others differ only in their symbols
    base_namespace: str = ""  # the model's, before the prompt and its media extended it
    scope: list[Any] = field(default_factory=list)


class DecoderOnlyHook(PatchingHook):
    """Installs itself as `model.generate`; `detach` puts the original back."""

    def __init__(self, store: Store, model: Any, serving: Serving) -> None:
        super().__init__(store, model, serving)
        self._one_token_steps = False
        if serving.profile.unsupported is not None:
            return  # every call runs cold (`checks.py`): nothing of the model to patch, which may not even have it
        if not serving.profile.prompt_sliced:
            self._keep(_skip_cached_ids(model, slice_mask=True, cache_kwarg=serving.profile.cache_kwarg))
        elif serving_modes(serving.profile).assisted:
            # Assisted decoding feeds its first forward the whole prompt, whatever the cache holds.
            self._keep(_skip_cached_ids(model, slice_mask=False))
        # Recurrence kept in module attributes (RecurrentGemma) is kept in the working cache's layers instead.
        bridge = ModuleStateBridge.install(model, WorkingCache)
        if bridge is not None:
            self._keep(bridge)
        scan: ScanContinuation | None = None
        if serving.profile.single_token_steps and bridge is None:
            scan = ScanContinuation.install(model, lambda cache: isinstance(cache, WorkingCache))
            if scan is None:
                logger.warning(
                    "%s: cannot continue its selective scan over several tokens; resumed prompts are fed "
                    "one token per forward",
                    type(model).__name__,
                )
            else:
                self._keep(scan)
        # One forward per token once a state exists (only when the scan cannot be continued exactly).
        self._one_token_steps = serving.profile.single_token_steps and scan is None
        if serving.profile.media is not None and expands_media(model):
            # Beams and several sequences: the suffix's encoded media copied whole to each row.
            self._keep(expand_suffix_media(model))
        if serving.profile.watch_indexers:
            # Sparse-attention indexers: a tie at the top-k boundary stops reuse (`model/indexer_ties.py`).
            watch = TieWatch.install(model, WorkingCache)
            if watch is not None:
                self._keep(watch)

    # ----------------------------------------------------------------- request
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """One `generate` call: check, key, restore, generate, store (each step below)."""
        store = self._store
        ours, session = pipeline.claim(store, self._model, kwargs, self._serving.serves_uncached)
        if not ours:
            return self._original(*args, **kwargs)
        call, refused = self._read_call(args, kwargs, session)
        reason: str | pipeline.Cold | None = refused
        if reason is None:
            try:
                reason = self._key(call)
            except InconsistentStateError as exc:  # the prompt's media symbols failed a guard
                reason = pipeline.guard_failed(exc)
        if reason is not None:
            return pipeline.run_cold(store, self._original, reason, call.prompt_len, args, kwargs)
        if self._profile.has_state and (len(call.rows) > 1 or call.expand > 1 or any(call.pads)):
            return self._serve_state_rows(call)  # each row prefilled alone, then joined (`recurrent_rows.py`)
        if any(call.pads) or (len(call.rows) > 1 and any(row != call.rows[0] for row in call.rows[1:])):
            return self._serve_rows(call)  # rows of their own; identical rows restore once, broadcast
        restored = pipeline.restore(store, self._profile, call.key, call.rows, expand=call.expand)
        if isinstance(restored, pipeline.Cold):
            return pipeline.run_cold(store, self._original, restored, call.prompt_len, args, kwargs)
        lease, cache = restored
        cold_kwargs = dict(kwargs)  # `_run` hands generate the working cache in `kwargs`
        try:
            output, snapshots = self._run(call, lease, cache)
        except IndexerTie:
            # The prompt's suffix tied at an indexer's top-k: a full prefill may keep other keys.
            return pipeline.run_cold(store, self._original, reasons.INDEXER_TIE, call.prompt_len, args, cold_kwargs)
        except InconsistentStateError as exc:  # the prefill (or a bridge) failed a guard: no answer from these states
            return pipeline.run_cold(
                store, self._original, pipeline.guard_failed(exc), call.prompt_len, args, cold_kwargs
            )
        finally:
            store.release(lease)
        if call.static is not None:
            copied = from_static(call.static, cache)  # the buffers are this call's: copy what to store out
            if copied is None:  # a sliding layer wrote past its window: the earliest positions are gone
                store.record(Served(len(call.rows[0]), lease.cached_len))
                store.record(ReducedReuse(reasons.STATIC_WINDOW))
                return output
            cache = copied
        try:
            self._store_result(call, lease, cache, output, snapshots)
        except InconsistentStateError as exc:  # the cache the answer came from disagrees with it: not trusted
            cold = pipeline.guard_failed(exc, reasons.INCONSISTENT_CAPTURE)
            return pipeline.run_cold(store, self._original, cold, call.prompt_len, args, cold_kwargs)
        return output

    def _read_call(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], session: Session | None
    ) -> tuple[_Call, str | None]:
        """Step 1, check: the call's ids and settings, or why it cannot reuse safely."""
        arguments = self._arguments(args, kwargs)
        input_ids = arguments.get("inputs")
        if input_ids is None:
            # Passed by name, or positionally to a generate naming it (Nemotron 3.5 Transcribe's).
            input_ids = arguments.get("input_ids")
        prompt_len = int(input_ids.shape[-1]) if isinstance(input_ids, torch.Tensor) else 0
        call = _Call(args, kwargs, input_ids, prompt_len, session)
        checked = check_call(self._profile, self._model, self._signature, input_ids, arguments, kwargs)
        settings, reason = checked.settings, checked.reason
        if settings is None:
            return call, reason  # refused before the prompt was read
        call.rows, call.pads = checked.rows, checked.pads
        if reason is None and any(call.pads) and not _serves_padding(self._profile):
            reason = reasons.PADDING
        # "dynamic" (or Gemma's default "hybrid"): the working cache is one; cold runs keep the setting.
        call.drop_impl = bool(settings.cache_implementation)
        call.expand, call.beams = settings.expand, (settings.num_beams or 1) > 1
        call.assisted = settings.assisted or arguments.get("assistant_model") is not None
        if settings.static is not None:
            # Sized as generate sizes it: the longest sequence but its last token (or the config's own size).
            new = settings.max_new_tokens
            longest = prompt_len + new if new is not None else settings.max_length
            call.static_len = max(longest - 1, settings.max_cache_len or 0)
            if reason is None and (len(call.rows) > 1 or any(call.pads)):
                # Static rows restore one prompt.
                reason = reasons.with_detail(reasons.CACHE_IMPLEMENTATION, settings.static)
        return call, reason

    def _key(self, call: _Call) -> str | None:
        """Step 2, key: the prompt's tree symbols (media as symbols) and the store's namespace for them."""
        store, media = self._store, self._profile.media
        layout, reason = media_layout(self._profile, call.rows, call.kwargs)
        if reason is not None:
            return reason
        call.layout = layout
        # Placeholders become media symbols: a stored prefix matches only if tokens and media do.
        symbols = layout.symbols(call.rows[0]) if layout is not None else call.rows[0]
        namespace = call.base_namespace = store.namespace()
        if media is not None and media.whole_prompt_only:
            # Prefix-LM: every prompt position sees the whole prompt; only the same prompt may share states.
            prompt = [str(s) for s in symbols]
            namespace = sub_namespace(namespace, prompt, media.prompt_parts(call.kwargs))
        call.scope = media.scope(layout.items) if media is not None and layout is not None else []
        if call.scope:
            # Every position sees every medium of the prompt: share only between prompts with the same media.
            namespace = sub_namespace(namespace, call.scope)
        spans = layout.spans if layout is not None else ()
        call.key = PrefixKey(namespace, symbols, spans, spans if self._profile.item_layers else ())
        return None

    def _run(self, call: _Call, lease: Lease, cache: WorkingCache) -> tuple[Any, list[Snapshot]]:
        """Step 4, generate: prefill recurrent states, then the original `generate` on the restored cache."""
        profile, media, kwargs = self._profile, self._profile.media, call.kwargs
        if call.scope and lease.matched_len == 0 and call.layout is not None:
            self._count_new_media(call.base_namespace, call.layout)
        snapshots: list[Snapshot] = []
        fed = lease.cached_len
        cache.prompt_len = call.prompt_len  # which indexer rows are the prompt's (`model/indexer_ties.py`)
        if profile.has_state and not (call.assisted and profile.has_recurrence):
            # Assisted decoding's first forward computes its last candidates' states one token at a time, and a cold
            # run's takes the whole prompt: generate feeds all the cache lacks, so the same tokens are sequential.
            fed, snapshots = self._prefill(call, lease, cache)
        if not profile.prompt_sliced or call.assisted:
            cache.skip_len = fed
        if media is not None and call.layout is not None and fed:
            # Only the media of what the cache lacks go to generate (plus explicit positions for M-RoPE).
            kwargs = media.resume_kwargs(call.input_ids, kwargs, call.layout, fed)
        kwargs[profile.cache_kwarg] = cache
        if call.static_len:
            # The prefix copied into preallocated buffers, as generate would allocate them (`model/static.py`).
            call.static = to_static(cache, self._model.config, call.static_len)
            kwargs[profile.cache_kwarg] = call.static
        if call.drop_impl:
            kwargs[CACHE_IMPLEMENTATION] = None
        return self._original(*call.args, **kwargs), snapshots

    def _serve_rows(self, call: _Call) -> Any:
        """Steps 3-5 for a batch (or a left-padded row): each row restores its own stored prefix.

        The rows share the cache's columns, so each reuses what lies before the column all of them
        reach (`pipeline.restore_rows`); `generate` gets the caller's ids and mask unchanged, so its
        positions, masks, processors and outputs are those of the cold call.
        """
        store, profile = self._store, self._profile
        restored = pipeline.restore_rows(
            store, profile, [call.key.with_symbols(row) for row in call.rows], call.pads, call.expand
        )
        if isinstance(restored, pipeline.Cold):
            return pipeline.run_cold(store, self._original, restored, call.prompt_len, call.args, call.kwargs)
        leases, cache, length = restored
        cold_kwargs, kwargs = dict(call.kwargs), call.kwargs
        kwargs[profile.cache_kwarg] = cache
        if call.drop_impl:
            kwargs[CACHE_IMPLEMENTATION] = None
        if call.assisted:
            cache.skip_len = length
        cache.prompt_len = call.prompt_len  # which indexer rows are the prompt's (`model/indexer_ties.py`)
        try:
            output = self._original(*call.args, **kwargs)
        except IndexerTie:
            # A row's suffix tied at an indexer's top-k: the cold batch's prefill may keep other keys.
            return pipeline.run_cold(
                store, self._original, reasons.INDEXER_TIE, call.prompt_len, call.args, cold_kwargs
            )
        except InconsistentStateError as exc:
            cold = pipeline.guard_failed(exc)
            return pipeline.run_cold(store, self._original, cold, call.prompt_len, call.args, cold_kwargs)
        finally:
            pipeline.release_all(store, leases)
        reused = [max(length - pad, 0) for pad in call.pads]
        try:
            if call.beams:
                # As in `_store_result`: the prompt of each row, from the first of its beams.
                cache.trim(call.prompt_len, range(0, len(call.rows) * call.expand, call.expand))
                pipeline.store_rows(store, call.key, call.input_ids, cache, call.pads, reused)
            else:
                expanded = [i for i in range(len(call.rows)) for _ in range(call.expand)]
                sequences = output if isinstance(output, torch.Tensor) else output.sequences
                pads, computed = [call.pads[i] for i in expanded], [reused[i] for i in expanded]
                pipeline.store_rows(store, call.key, sequences, cache, pads, computed)
        except InconsistentStateError as exc:  # as in `__call__`: the answer is not trusted either
            cold = pipeline.guard_failed(exc, reasons.INCONSISTENT_CAPTURE)
            return pipeline.run_cold(store, self._original, cold, call.prompt_len, call.args, cold_kwargs)
        store.record(
            Served(call.prompt_len, length, len(call.rows), rows=tuple(zip(map(len, call.rows), reused, strict=True)))
        )
        if any(lease.cached_len > used for lease, used in zip(leases, reused, strict=True)):
            store.record(ReducedReuse(reasons.BATCH_LAYOUT))  # a row had more stored than the shared column allows
        logger.info("prefix cache: reused %s of %s prompt tokens by row", reused, [len(row) for row in call.rows])
        if cache.tied_at is not None:
            store.record(ReducedReuse(reasons.INDEXER_TIE))  # stored only up to the tie (`exact_length`)
        return output

    def _serve_state_rows(self, call: _Call) -> Any:
        """Steps 3-5 for rows of their own (a batch, left padding, beams, samples) on a model with recurrent states."""
        rows = recurrent_rows.StateRows(
            call.args,
            call.kwargs,
            call.input_ids,
            call.rows,
            call.pads,
            call.expand,
            call.beams,
            call.key,
            call.drop_impl,
        )
        store = self._store
        prefill = recurrent_rows.Prefill(
            self._model, self._profile, self._serving.snapshot_interval, self._one_token_steps
        )
        return recurrent_rows.serve(store, prefill, self._original, rows, CACHE_IMPLEMENTATION)

    def _prefill(self, call: _Call, lease: Lease, cache: WorkingCache) -> tuple[int, list[Snapshot]]:
        """Recurrent models: feed the uncached prompt in chunks, snapshotting where wanted (`recurrent_prefill.py`)."""
        media = self._profile.media
        embeds = self._suffix_embeds(call.input_ids, call.kwargs, call.layout, lease.cached_len)
        positions = media.prefill_positions(call.input_ids, call.kwargs) if media is not None else None
        return prefill_states(
            self._model,
            self._profile,
            cache,
            call.input_ids,
            lease,
            self._serving.snapshot_interval,
            self._one_token_steps,
            embeds,
            call.key.spans,
            self._serving.prompt_snapshot,
            positions,
        )

    def _store_result(
        self, call: _Call, lease: Lease, cache: WorkingCache, output: Any, snapshots: list[Snapshot]
    ) -> None:
        """Step 5, store: store each finished row with its states, then count the request.

        Raises:
            InconsistentStateError: the cache disagrees with the finished sequence (an exactness guard): nothing
                is counted, and the caller reruns the call cold.
        """
        self._insert(call, lease, cache, output, snapshots)
        store, rows, prompt_len = self._store, call.rows, call.prompt_len  # no row has padding here (`__call__`)
        has_media = call.layout is not None and bool(call.layout.items)
        # Media symbols split the hit by modality; a prompt without media is all text (no scan).
        store.record(Served(prompt_len, lease.cached_len, len(rows), call.key.symbols if has_media else None))
        logger.info(
            "prefix cache: reused %d of %d prompt tokens%s",
            lease.cached_len,
            prompt_len,
            f" (x{len(rows)} rows)" if len(rows) > 1 else "",
        )
        logger.debug(
            "matched %d tokens, restored %d, namespace %s", lease.matched_len, lease.cached_len, call.key.namespace
        )
        if call.layout is not None and call.layout.items:
            count_media_padding(store, call.key, call.layout, lease)  # reuse lost to a medium's padding
        if cache.tied_at is not None:
            store.record(ReducedReuse(reasons.INDEXER_TIE))  # stored only up to the tie (`exact_length`)

    def _insert(self, call: _Call, lease: Lease, cache: WorkingCache, output: Any, snapshots: list[Snapshot]) -> None:
        """Each finished row (a beam search's prompt, once) stored with its states and its media item states."""
        store, rows = self._store, call.rows
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        items: list[ItemState] = []
        if call.key.item_spans:
            # The cross-attention layers now hold every image; the restored ones are stored already.
            items = cache.capture_items([end for _, end in call.key.item_spans], lease.num_items)
        kv_len = cache.kv_length()
        repeat = kv_len is not None and kv_len <= lease.matched_len and not self._profile.has_state
        if repeat and not (items or call.session):
            return  # an exact repeat: the request added nothing to what it matched (and marked used) when acquired
        if call.beams:
            # The finished beams are not the cache's rows (beams are reordered every step and end at
            # different steps), but every row holds the same prompt: store the prompt once, from the first.
            cache.trim(call.prompt_len, range(0, len(rows) * call.expand, call.expand))
            sequences = call.input_ids
        elif call.assisted:
            # Rejected candidates were cropped off as views: copy out what is kept, so no bytes hang on.
            assert kv_len is not None
            cache.trim(kv_len, range(len(rows)))
        # All the cache holds, unless an indexer tied (`model/indexer_ties.py`).
        keys = pipeline.sequence_keys(call.key, sequences, cache.exact_length())
        batched = len(keys) > 1  # each row stores its row of the cache; a session and media items are one row's
        for row, key in enumerate(keys):
            store.insert_sequence(
                key,
                cache,
                snapshots,
                row=row if batched else None,
                session=None if batched else call.session,
                items=[s for s in items if s.length <= len(key.symbols)] if items and not batched else (),
                computed_from=lease.cached_len,
            )

    def _count_new_media(self, base_namespace: str, layout: MediaLayout) -> None:
        """Count the adapter's event when this prompt's media extend those of a stored conversation."""
        store, media = self._store, self._profile.media
        assert media is not None
        if media.new_item_reason is None:
            return
        for j in range(len(layout.items) - 1, 0, -1):
            if store.has_entries(sub_namespace(base_namespace, media.scope(layout.items[:j]))):
                store.record(ReducedReuse(media.new_item_reason))
                return

    def _suffix_embeds(
        self, input_ids: torch.Tensor, kwargs: dict[str, Any], layout: MediaLayout | None, cached_len: int
    ) -> torch.Tensor | None:
        """For a state prefill: the embeddings of `[cached_len, n)` when media lie there (else None: feed ids)."""
        media = self._profile.media
        if media is None or layout is None or cached_len >= input_ids.shape[1] - 1:
            return None
        if not any(item.end > cached_len for item in layout.items):
            return None  # the suffix is text: its ids embed the same way
        with torch.no_grad():
            return media.suffix_embeds(input_ids, kwargs, layout, cached_len)


def _serves_padding(profile: ModelProfile) -> bool:
    """Whether left-padded rows can restore behind their padding: transformers gives the fed positions ids from
    the mask (the model takes `position_ids`) and masks the cached padding columns (`generate` slices the prompt
    and hands the model the whole mask); layers of per-token keys only; no media, which are keyed for one row.
    Rows with recurrent states are prefilled alone (`recurrent_rows.py`): masked padding leaves a state as it was,
    and positions follow the mask where the model takes them (a model of states alone has none)."""
    if profile.joins_rows:
        return profile.accepts_position_ids or not profile.has_kv
    # Qwen4-Exp's indexers keep positions, which a restore rebuilds as 0..L-1: not a padded row's.
    rebuilt = profile.keeps_positions
    return (
        profile.accepts_position_ids
        and profile.prompt_sliced
        and profile.expands
        and profile.media is None
        and not rebuilt
    )


def _skip_cached_ids(model: Any, slice_mask: bool, cache_kwarg: str | None = None) -> InstancePatch:
    """Where `generate` does not slice the prompt by the cache (`_compat.generate_slices_prompt`, and the first
    forward of assisted decoding), skip what the working cache holds; `slice_mask` for the former, whose
    forwards take the mask of the fed ids only. `cache_kwarg`: a model's own name for it (RWKV's `state`)."""

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
