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
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from transformers import GenerationConfig

from hf_prefix_cache import _compat, reasons
from hf_prefix_cache.errors import UnhashableMediaError
from hf_prefix_cache.integration import pipeline, refusals
from hf_prefix_cache.integration.patching import InstancePatch
from hf_prefix_cache.integration.recurrent_prefill import prefill_states
from hf_prefix_cache.integration.registry import DECODER_ONLY, Family, register
from hf_prefix_cache.integration.scan import ScanContinuation
from hf_prefix_cache.keys.namespace import fingerprint
from hf_prefix_cache.model.states import Snapshot
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.multimodal import MEDIA_KWARGS
from hf_prefix_cache.multimodal.media import MediaLayout
from hf_prefix_cache.store.contract import Store

logger = logging.getLogger("hf_prefix_cache")

# Generation settings (they steer decoding, not the prompt's states).
_GENERATION_FIELDS = frozenset(GenerationConfig().to_dict())  # type: ignore[no-untyped-call]
# Other generate kwargs the key covers (ids, an all-ones mask) or that leave states alone.
_KEYED_OR_HARMLESS = frozenset(
    {"input_ids", "attention_mask", "logits_to_keep", "tokenizer", "assistant_tokenizer", "use_model_defaults"}
)
# Cache implementations served on the working cache (dropped from the call).
_SERVED_IMPLEMENTATIONS = frozenset({"dynamic"})


class DecoderOnlyHook:
    """Installs itself as `model.generate`; `detach` puts the original back."""

    def __init__(self, store: Store, model: Any) -> None:
        self._store = store
        self._model = model
        self._generate = InstancePatch(model, "generate", self)
        self._original = self._generate.original
        self._signature = pipeline.generate_signature(model, self._original)
        self._prepare: InstancePatch | None = None
        if not store.profile.prompt_sliced:
            self._prepare = _skip_cached_ids(model)
        self._scan: ScanContinuation | None = None
        if store.profile.single_token_steps:
            self._scan = ScanContinuation.install(model, lambda cache: isinstance(cache, WorkingCache))
            if self._scan is None:
                logger.warning(
                    "%s: cannot continue its selective scan over several tokens; resumed prompts are fed "
                    "one token per forward",
                    type(model).__name__,
                )
        # One forward per token once a state exists (only when the scan cannot be continued exactly).
        self._one_token_steps = store.profile.single_token_steps and self._scan is None

    def detach(self) -> None:
        self._generate.remove()
        if self._prepare is not None:
            self._prepare.remove()
            self._prepare = None
        if self._scan is not None:
            self._scan.remove()
            self._scan = None

    # ----------------------------------------------------------------- request
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        store = self._store
        profile = store.profile
        ours, session = pipeline.whose_call(store, self._model, _compat.cache_in(kwargs))
        if not ours:
            return self._original(*args, **kwargs)
        _compat.pop_cache(kwargs)
        # 1. check
        bound = self._signature.bind_partial(*args, **kwargs)
        input_ids = bound.arguments.get("inputs")
        if input_ids is None:
            input_ids = kwargs.get("input_ids")
        reason = self._check(input_ids, bound.arguments, kwargs)
        if reason is None:  # the one read of the device before the prefill: ids, mask and pad tokens
            settings = refusals.GenerationSettings(self._model, bound.arguments.get("generation_config"), kwargs)
            assert isinstance(input_ids, torch.Tensor)
            rows, reason = refusals.read_prompt(input_ids, kwargs.get("attention_mask"), settings)
        if reason is not None:
            prompt_len = int(input_ids.shape[-1]) if isinstance(input_ids, torch.Tensor) else 0
            return pipeline.run_cold(store, self._original, reason, prompt_len, args, kwargs)
        assert isinstance(input_ids, torch.Tensor)
        # "dynamic" (or Gemma's default "hybrid"): the working cache is one; cold runs keep the setting.
        drop_impl = bool(settings.cache_implementation)
        # 2. key
        layout, reason = self._media_layout(rows, kwargs)
        if reason is not None:
            return pipeline.run_cold(store, self._original, reason, len(rows[0]), args, kwargs)
        # Placeholders become media symbols: a stored prefix matches only if tokens and media do.
        symbols: Sequence[Hashable] = layout.symbols(rows[0]) if layout is not None else rows[0]
        namespace = base_namespace = store.namespace()
        media = profile.media
        if media is not None and media.whole_prompt_only:
            # Prefix-LM: every prompt position sees the whole prompt; only the same prompt may share states.
            namespace = fingerprint([namespace, [str(s) for s in symbols], media.prompt_parts(kwargs)])
        scope = media.scope(layout.items) if media is not None and layout is not None else []
        if scope:
            # Every position sees every medium of the prompt: share only between prompts with the same media.
            namespace = fingerprint([namespace, scope])
        spans = layout.spans if layout is not None else ()
        item_spans = spans if profile.item_layers else ()
        # 3. restore
        restored = pipeline.restore_rows(store, namespace, rows, symbols, spans, item_spans)
        if restored is None:
            return pipeline.run_cold(store, self._original, reasons.OUT_OF_MEMORY, len(rows[0]), args, kwargs)
        lease, cache = restored
        # 4. generate
        try:
            if scope and lease.matched_len == 0 and layout is not None:
                self._count_new_media(base_namespace, layout)
            snapshots: list[Snapshot] = []
            fed = lease.cached_len
            if profile.has_state:
                embeds = self._suffix_embeds(input_ids, kwargs, layout, lease.cached_len)
                positions = media.prefill_positions(input_ids, kwargs) if media is not None else None
                fed, snapshots = prefill_states(
                    self._model,
                    profile,
                    cache,
                    input_ids,
                    lease,
                    store.snapshot_interval,
                    self._one_token_steps,
                    embeds,
                    spans,
                    store.prompt_snapshot,
                    positions,
                )
            if not profile.prompt_sliced:
                cache.skip_len = fed
            if media is not None and layout is not None and fed:
                # Only the media of what the cache lacks go to generate (plus explicit positions for M-RoPE).
                kwargs = media.resume_kwargs(input_ids, kwargs, layout, fed)
            kwargs[profile.cache_kwarg] = cache
            if drop_impl:
                kwargs[refusals.CACHE_IMPLEMENTATION] = None
            output = self._original(*args, **kwargs)
        finally:
            store.release(lease)
        # 5. store
        has_media = layout is not None and bool(layout.items)
        # Media symbols split the hit by modality; a prompt without media is all text (no scan).
        store.count_request(len(rows[0]), lease.cached_len, num_rows=len(rows), symbols=symbols if has_media else None)
        logger.info(
            "prefix cache: reused %d of %d prompt tokens%s",
            lease.cached_len,
            len(rows[0]),
            f" (x{len(rows)} rows)" if len(rows) > 1 else "",
        )
        logger.debug("matched %d tokens, restored %d, namespace %s", lease.matched_len, lease.cached_len, namespace)
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        # The cross-attention layers now hold every image; the restored ones are stored already.
        items = cache.capture_items([end for _, end in item_spans], lease.num_items) if item_spans else []
        if pipeline.is_exact_repeat(store, cache, lease) and not (items or session):
            return output  # an exact repeat: all of it was matched (and marked used) when acquired
        pipeline.store_sequences(
            store,
            namespace,
            sequences,
            cache,
            snapshots,
            symbols if has_media else None,  # media symbols replace a one-row prompt's placeholders
            session,
            items,
            lease.cached_len,
        )
        return output

    def _count_new_media(self, base_namespace: str, layout: MediaLayout) -> None:
        """Count the adapter's event when this prompt's media extend those of a stored conversation."""
        media = self._store.profile.media
        assert media is not None
        if media.new_item_reason is None:
            return
        for j in range(len(layout.items) - 1, 0, -1):
            if self._store.has_entries(fingerprint([base_namespace, media.scope(layout.items[:j])])):
                self._store.count_reduced_reuse(media.new_item_reason)
                return

    def _suffix_embeds(
        self, input_ids: torch.Tensor, kwargs: dict[str, Any], layout: MediaLayout | None, cached_len: int
    ) -> torch.Tensor | None:
        """For a state prefill: the embeddings of `[cached_len, n)` when media lie there (else None: feed ids)."""
        media = self._store.profile.media
        if media is None or layout is None or cached_len >= input_ids.shape[1] - 1:
            return None
        if not any(item.end > cached_len for item in layout.items):
            return None  # the suffix is text: its ids embed the same way
        with torch.no_grad():
            return media.suffix_embeds(input_ids, kwargs, layout, cached_len)

    def _media_layout(self, rows: list[list[int]], kwargs: dict[str, Any]) -> tuple[MediaLayout | None, str | None]:
        """The prompt's media items (None for a model without media handling), or why to run cold."""
        media = self._store.profile.media
        if media is None:
            return None, None
        reason = media.why_cold(rows[0], kwargs)
        if reason is not None:
            return None, reason
        try:
            layout = media.layout(rows[0], kwargs)
        except UnhashableMediaError as err:
            logger.debug("media not hashable: %s", err)
            return None, reasons.UNHASHABLE_MEDIA
        if layout is None:
            return None, reasons.MEDIA_PLACEHOLDERS
        if self._store.profile.has_state and layout.items and layout.items[-1].end >= len(rows[0]):
            # The prefill stops before the last token and generate feeds it alone, with no media.
            return None, reasons.MEDIA_PROMPT_END
        return layout, None

    def _check(self, input_ids: Any, arguments: dict[str, Any], kwargs: dict[str, Any]) -> str | None:
        """Name the reason this call cannot reuse safely, or None."""
        store, model = self._store, self._model
        profile = store.profile
        if profile.unsupported is not None:
            return profile.unsupported
        refused = refusals.refused_argument({**kwargs, **arguments})
        if refused is not None:
            return refused
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            return reasons.NO_INPUT_IDS
        if input_ids.shape[0] != 1 and profile.has_state:
            # Recurrent states would need one snapshot chain per row.
            return reasons.BATCH_SIZE
        if input_ids.shape[1] == 0:
            return reasons.EMPTY_PROMPT
        if profile.exact_prompt_len is not None and input_ids.shape[1] > profile.exact_prompt_len:
            return reasons.with_detail(reasons.INDEXER_TOP_K, profile.exact_prompt_len)
        media = profile.media
        if input_ids.shape[0] != 1 and media is not None and (media.has_positions or media.whole_prompt_only):
            # Positions and prompt-wide namespaces are computed for one row.
            return reasons.MROPE_BATCH if media.has_positions else reasons.PREFIX_LM_BATCH
        media_names = [name for name in MEDIA_KWARGS if kwargs.get(name) is not None]
        if media is None and media_names == ["token_type_ids"]:
            media_names = []  # a text model's segment ids (GPT-2): a model kwarg like any other, refused below
        if media_names:
            if media is None:
                return reasons.with_detail(reasons.MEDIA_INPUTS, getattr(model.config, "model_type", None))
            unknown = [name for name in media_names if name not in media.handled]
            if unknown:
                return reasons.with_detail(reasons.MEDIA_INPUTS, unknown[0])
            if input_ids.shape[0] != 1:
                return reasons.MEDIA_BATCH
            if profile.has_state and not media.embeds_suffix:
                return reasons.MEDIA_RECURRENT
        passed = self._model_kwarg(kwargs)
        if passed is not None:
            # It reaches the model's forward and may change states the key does not cover (GPT-2's token_type_ids).
            return reasons.with_detail(reasons.MODEL_KWARG, passed)
        config = refusals.GenerationSettings(model, arguments.get("generation_config"), kwargs)
        problem = refusals.decoding_problem(config) or refusals.cache_implementation_problem(
            config, _SERVED_IMPLEMENTATIONS
        )
        if problem is not None:
            return problem
        if config.return_dict_in_generate and (problem := refusals.output_problem(config)) is not None:
            return problem
        return None  # the mask and pad tokens are read with the ids (`refusals.read_prompt`)

    def _model_kwarg(self, kwargs: dict[str, Any]) -> str | None:
        """The first kwarg that `generate` would hand the model and the key does not cover, or None."""
        media = self._store.profile.media
        handled = media.handled | set(media.settings) if media is not None else frozenset()
        for name, value in kwargs.items():
            if value is None or name in _KEYED_OR_HARMLESS or name in handled or name in _GENERATION_FIELDS:
                continue
            if name in self._signature.parameters:
                continue
            return name
        return None


def _skip_cached_ids(model: Any) -> InstancePatch:
    """Where `generate` does not slice the prompt by the cache (`_compat.generate_slices_prompt`), skip what
    the working cache holds."""

    def prepare_inputs_for_generation(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        cache = _compat.cache_in(kwargs)
        if isinstance(cache, WorkingCache) and cache.skip_len:
            skip, cache.skip_len = cache.skip_len, None
            kwargs["next_sequence_length"] = input_ids.shape[1] - skip
            mask = kwargs.get("attention_mask")
            if mask is not None:
                kwargs["attention_mask"] = mask[:, skip:]
        return patch.original(input_ids, *args, **kwargs)

    patch = InstancePatch(model, "prepare_inputs_for_generation", prepare_inputs_for_generation)
    return patch


register(Family(DECODER_ONLY, DecoderOnlyHook))
