"""GenerateHook: key -> match -> restore -> prefill states -> generate -> insert.

Wraps one model's `generate` so that `model.generate(..., past_key_values=store)` runs on a
working cache restored from the store. `generate` always receives the full prompt ids (so
streamers, logits processors and the returned sequences are as in a cold run); transformers
then feeds the model only the uncached suffix. Requests that cannot reuse safely run the
original `generate` untouched, and the reason is counted.

Prompts with media (models with a `MediaAdapter`) are keyed by tokens and media content
together; `generate` then gets only the media of the uncached suffix, and M-RoPE models get
explicit positions of the whole prompt. Cross-attention models (Mllama) also restore the
vision keys/values of the prefix's images (item states) and store those of new images.

For models with recurrent layers the hook prefills the uncached prompt itself, in chunks that
end where snapshots are wanted (the divergence from the stored prefix, every
`snapshot_interval` tokens, the token before the last), and leaves the last token to
`generate`. Models whose own multi-token scan ignores a cached state (Mamba, FalconMamba,
Jamba) continue it through `scan.ScanContinuation`, so their chunks are exact too.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Any, cast

import torch
from transformers import GenerationConfig

from hf_prefix_cache.errors import IncompatibleModelError, UnhashableMediaError
from hf_prefix_cache.integration.scan import ScanContinuation
from hf_prefix_cache.keys.namespace import fingerprint
from hf_prefix_cache.model.states import Snapshot
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.multimodal import MEDIA_KWARGS
from hf_prefix_cache.multimodal.media import MediaLayout
from hf_prefix_cache.storage.tiers import is_out_of_memory
from hf_prefix_cache.store.sessions import Session
from hf_prefix_cache.store.tree_store import Plan, PrefixCache

logger = logging.getLogger("hf_prefix_cache")

# Generation settings (they steer decoding, not the prompt's states).
_GENERATION_FIELDS = frozenset(GenerationConfig().to_dict())  # type: ignore[no-untyped-call]
# Other generate kwargs the key covers (ids, an all-ones mask) or that leave states alone.
_KEYED_OR_HARMLESS = frozenset(
    {"input_ids", "attention_mask", "logits_to_keep", "tokenizer", "assistant_tokenizer", "use_model_defaults"}
)


_IMPL = "cache_implementation"


class GenerateHook:
    """Installs itself as `model.generate`; `detach` puts the original back."""

    def __init__(self, store: PrefixCache, model: Any) -> None:
        self._store = store
        self._model = model
        self._original = model.generate
        self._signature = inspect.signature(self._original)
        base = getattr(model, "get_base_model", None)
        if callable(base) and base() is not model:
            # A PeftModel's generate takes (*args, **kwargs) and hands them to its base model's.
            self._signature = inspect.signature(base().generate)

        # Another store's wrapper, when this model already has one: put back on detach, not deleted.
        self._outer: Any = model.__dict__.get("generate")
        self._detached = False

        @functools.wraps(self._original)
        def generate(*args: Any, **kwargs: Any) -> Any:
            if self._detached:  # detached while a later store's wrapper still calls this one
                return self._original(*args, **kwargs)
            return self(*args, **kwargs)

        generate._prefix_cache_hook = self  # type: ignore[attr-defined]
        model.generate = generate
        self._wrapper = generate
        self._original_prepare: Callable[..., Any] | None = None
        self._outer_prepare: Any = None
        self._prepare_wrapper: Any = None
        if store.profile.cache_kwarg == "cache_params":
            self._patch_prepare_inputs()
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
        self._detached = True
        if self._model.__dict__.get("generate") is self._wrapper:
            outer = self._outer
            while outer is not None and getattr(getattr(outer, "_prefix_cache_hook", None), "_detached", False):
                outer = outer._prefix_cache_hook._outer  # an earlier store detached meanwhile: skip its wrapper
            if outer is not None:
                self._model.generate = outer
            else:
                del self._model.generate
        if self._original_prepare is not None:
            if self._model.__dict__.get("prepare_inputs_for_generation") is self._prepare_wrapper:
                if self._outer_prepare is not None:
                    self._model.prepare_inputs_for_generation = self._outer_prepare
                else:
                    del self._model.prepare_inputs_for_generation
            self._original_prepare = None
        if self._scan is not None:
            self._scan.remove()
            self._scan = None

    # ----------------------------------------------------------------- request
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        store = self._store
        cache_kwarg = store.profile.cache_kwarg
        session, given = unwrap_session(kwargs.get("past_key_values", kwargs.get("cache_params")))
        if given is not store:
            if isinstance(given, PrefixCache) and given.model is not self._model:
                raise IncompatibleModelError(
                    f"this PrefixCache was built for another model object ({_describe(given.model)}; this one is "
                    f"{_describe(self._model)}): a store serves only the model it was made with, even among models "
                    "of one class. Make one for this model: PrefixCache(model)"
                )
            return self._original(*args, **kwargs)
        kwargs.pop("past_key_values", None)
        kwargs.pop("cache_params", None)
        bound = self._signature.bind_partial(*args, **kwargs)
        input_ids = bound.arguments.get("inputs")
        if input_ids is None:
            input_ids = kwargs.get("input_ids")
        reason = self._why_cold(input_ids, bound.arguments, kwargs)
        if reason is not None:
            prompt_len = int(input_ids.shape[-1]) if isinstance(input_ids, torch.Tensor) else 0
            return self._run_cold(reason, prompt_len, args, kwargs)
        assert isinstance(input_ids, torch.Tensor)
        # "dynamic" (or Gemma's default "hybrid"): the working cache is one; cold runs keep the setting.
        drop_impl = bool(
            GenerationSettings(self._model, bound.arguments.get("generation_config"), kwargs).cache_implementation
        )
        rows = input_ids.tolist()
        layout, reason = self._media_layout(rows, kwargs)
        if reason is not None:
            return self._run_cold(reason, len(rows[0]), args, kwargs)
        # Placeholders become media symbols: a stored prefix matches only if tokens and media do.
        symbols: Sequence[Hashable] = layout.symbols(rows[0]) if layout is not None else rows[0]
        namespace = base_namespace = store.namespace()
        media = store.profile.media
        if media is not None and media.whole_prompt_only:
            # Prefix-LM: every prompt position sees the whole prompt; only the same prompt may share states.
            namespace = fingerprint([namespace, [str(s) for s in symbols], media.prompt_parts(kwargs)])
        scope = media.scope(layout.items) if media is not None and layout is not None else []
        if scope:
            # Every position sees every medium of the prompt: share only between prompts with the same media.
            namespace = fingerprint([namespace, scope])
        spans = layout.spans if layout is not None else ()
        item_spans = spans if store.profile.item_layers else ()
        restored = self._restore(namespace, rows, symbols, spans, item_spans)
        if restored is None:
            return self._run_cold("out_of_memory", len(rows[0]), args, kwargs)
        plan, cache = restored
        num_restored_items = len(plan.items)
        try:
            if scope and plan.matched_len == 0 and layout is not None:
                self._count_new_media(base_namespace, layout)
            snapshots: list[Snapshot] = []
            fed = plan.restore_len
            if store.profile.has_state:
                fed, snapshots = self._prefill_states(cache, input_ids, plan)
            if cache_kwarg == "cache_params":
                cache.skip_len = fed
            if media is not None and layout is not None and plan.restore_len:
                # Only the suffix's media go to generate (plus explicit positions for M-RoPE).
                kwargs = media.resume_kwargs(input_ids, kwargs, layout, plan.restore_len)
            kwargs[cache_kwarg] = cache
            if drop_impl:
                kwargs[_IMPL] = None
            output = self._original(*args, **kwargs)
        finally:
            store.release(plan)
        # Media symbols split the hit by modality; a prompt without media is all text (no scan).
        has_media = layout is not None and bool(layout.items)
        store.count_request(len(rows[0]), plan.restore_len, num_rows=len(rows), symbols=symbols if has_media else None)
        logger.info(
            "prefix cache: reused %d of %d prompt tokens%s",
            plan.restore_len,
            len(rows[0]),
            f" (x{len(rows)} rows)" if len(rows) > 1 else "",
        )
        logger.debug("matched %d tokens, restored %d, namespace %s", plan.matched_len, plan.restore_len, namespace)
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        # Media symbols replace a prompt's placeholders; only one-row calls have media items.
        media_symbols = symbols if layout is not None and layout.items else None
        # The cross-attention layers now hold every image; the restored ones are stored already.
        items = cache.item_states([end for _, end in item_spans], num_restored_items) if item_spans else []
        kv_len = cache.kv_length()
        exact_repeat = kv_len is not None and kv_len <= plan.matched_len and not store.profile.has_state
        if exact_repeat and not (items or session):
            return output  # an exact repeat: all of it was matched (and marked used) when acquired
        self._store_result(namespace, sequences, cache, snapshots, media_symbols, session, items, plan.restore_len)
        return output

    def _run_cold(self, reason: str, prompt_len: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The original `generate`, untouched, with `reason` counted; logged only once the call ran (a call
        that transformers rejects, such as one with a misspelt kwarg, raises its own error unannounced)."""
        self._store.count_fallback(reason, prompt_len, log=False)
        output = self._original(*args, **kwargs)
        self._store.log_fallback(reason)
        return output

    def _count_new_media(self, base_namespace: str, layout: MediaLayout) -> None:
        """Count the adapter's event when this prompt's media extend those of a stored conversation."""
        media = self._store.profile.media
        assert media is not None
        if media.new_item_reason is None:
            return
        for j in range(len(layout.items) - 1, 0, -1):
            if self._store.has_entries(fingerprint([base_namespace, media.scope(layout.items[:j])])):
                self._store.count_event(media.new_item_reason)
                return

    def _restore(
        self,
        namespace: str,
        rows: list[list[int]],
        symbols: Sequence[Hashable],
        spans: Sequence[tuple[int, int]],
        item_spans: Sequence[tuple[int, int]] = (),
    ) -> tuple[Plan, WorkingCache] | None:
        """Acquire and restore the shared prefix of `rows`; None when the device ran out of memory twice.

        After a first out-of-memory error the store moves its unpinned entries off the device and
        tries once more. A failed attempt leaves nothing pinned and no half-restored cache.
        """
        store = self._store
        # Rows of a batch reuse only what all of them share; the last token is always fed, for its logits.
        shared = _common_prefix_len(rows)
        for attempt in range(2):
            plan: Plan | None = None
            try:
                plan = store.acquire(
                    namespace,
                    cast("Sequence[int]", symbols[:shared]),  # the tree compares any hashable symbols
                    limit=min(shared, len(rows[0]) - 1),
                    spans=spans,
                    item_spans=item_spans,
                )
                cache = store.new_cache()
                if plan.restore_len:
                    cache.restore(
                        plan.restore_len, plan.keys, plan.values, plan.snapshot, batch_size=len(rows), items=plan.items
                    )
                plan.keys = plan.values = None  # the cache holds them now
                return plan, cache
            except Exception as exc:
                if plan is not None:
                    store.release(plan)
                if not is_out_of_memory(exc):
                    raise
                logger.warning("out of memory restoring a cached prefix (attempt %d): %s", attempt + 1, exc)
                if attempt == 0:
                    store.relieve_device()
        return None

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
            return None, "unhashable_media"
        if layout is None:
            return None, "media_placeholders"
        return layout, None

    def _why_cold(self, input_ids: Any, arguments: dict[str, Any], kwargs: dict[str, Any]) -> str | None:
        """Name the reason this call cannot reuse safely, or None."""
        store, model = self._store, self._model
        if store.profile.unsupported is not None:
            return store.profile.unsupported
        if kwargs.get("inputs_embeds") is not None:
            return "inputs_embeds"
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            return "no_input_ids"
        if input_ids.shape[0] != 1 and store.profile.has_state:
            # Recurrent states would need one snapshot chain per row.
            return "batch_size"
        if input_ids.shape[1] == 0:
            return "empty_prompt"
        media = store.profile.media
        if input_ids.shape[0] != 1 and media is not None and (media.has_positions or media.whole_prompt_only):
            # Positions and prompt-wide namespaces are computed for one row.
            return "mrope_batch" if media.has_positions else "prefix_lm_batch"
        media_names = [name for name in MEDIA_KWARGS if kwargs.get(name) is not None]
        if media is None and media_names == ["token_type_ids"]:
            media_names = []  # a text model's segment ids (GPT-2): a model kwarg like any other, refused below
        if media_names:
            if media is None:
                return f"media_inputs:{getattr(model.config, 'model_type', None)}"
            unknown = [name for name in media_names if name not in media.handled]
            if unknown:
                return f"media_inputs:{unknown[0]}"
            if input_ids.shape[0] != 1:
                return "media_batch"
            if store.profile.has_state:
                return "media_recurrent"
        if kwargs.get("position_ids") is not None:
            return "explicit_position_ids"
        passed = self._model_kwarg(kwargs)
        if passed is not None:
            # It reaches the model's forward and may change states the key does not cover (GPT-2's token_type_ids).
            return f"model_kwarg:{passed}"
        if arguments.get("assistant_model") is not None:
            return "assisted_decoding"
        if arguments.get("custom_generate") is not None:
            return "custom_generate"
        if arguments.get("negative_prompt_ids") is not None:
            return "negative_prompt"
        config = GenerationSettings(model, arguments.get("generation_config"), kwargs)
        problem = decoding_problem(config)
        if problem is not None:
            return problem
        # transformers refuses a passed cache beside any cache_implementation, the model's default included
        # (hub configs name one); "dynamic" is what the store serves (the call drops it), Gemma's default
        # "hybrid" yields to a passed cache, anything else is another cache and runs cold.
        impl = config.cache_implementation
        if impl is not None and impl != "dynamic" and not (impl == "hybrid" and config.explicit(_IMPL) is None):
            return f"cache_implementation:{impl}"
        if config.return_dict_in_generate and (config.output_attentions or config.output_hidden_states):
            return "output_attentions" if config.output_attentions else "output_hidden_states"
        mask = kwargs.get("attention_mask")
        if mask is not None:
            if mask.shape != input_ids.shape:
                return "attention_mask_shape"
            if not bool((mask == 1).all()):
                return "padding"
        elif _infers_padding(input_ids, config):
            return "padding"
        return None

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

    # ----------------------------------------------------------- state prefill
    def _prefill_states(self, cache: WorkingCache, input_ids: torch.Tensor, plan: Plan) -> tuple[int, list[Snapshot]]:
        """Feed prompt tokens `[restore_len, n - 1)` in chunks, snapshotting at each chunk's end."""
        start, target = plan.restore_len, input_ids.shape[1] - 1
        if target <= start:
            return start, []
        bounds = {target}
        if start < plan.matched_len < target:
            bounds.add(plan.matched_len)
        interval = self._store.snapshot_interval
        if interval is not None and self._store.profile.has_recurrence:  # a window snapshot is not worth its bytes
            bounds.update(range((start // interval + 1) * interval, target, interval))
        ordered = sorted(bounds)
        if self._one_token_steps and start == 0:
            # From an empty state a multi-token scan is exact; skip interval snapshots it would pass.
            first = min(b for b in ordered if b == target or b == plan.matched_len)
            ordered = [b for b in ordered if b >= first]
        snapshots = []
        pos = start
        with torch.no_grad():
            for bound in ordered:
                if self._one_token_steps and pos > 0:
                    for t in range(pos, bound):
                        self._forward(cache, input_ids, t, t + 1)
                else:
                    self._forward(cache, input_ids, pos, bound)
                snapshots.append(cache.snapshot(bound))
                pos = bound
        return pos, snapshots

    def _forward(self, cache: WorkingCache, input_ids: torch.Tensor, start: int, end: int) -> None:
        profile = self._store.profile
        kwargs: dict[str, Any] = {profile.cache_kwarg: cache, "use_cache": True}
        if profile.accepts_position_ids:
            kwargs["position_ids"] = torch.arange(start, end, device=input_ids.device)[None]
        if profile.accepts_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        self._model(input_ids=input_ids[:, start:end], **kwargs)

    def _store_result(
        self,
        namespace: str,
        sequences: torch.Tensor,
        cache: WorkingCache,
        snapshots: list[Snapshot],
        prompt_symbols: Sequence[Hashable] | None,
        session: Session | None = None,
        items: Sequence[Snapshot] = (),
        computed_from: int = 0,
    ) -> None:
        kv_len = cache.kv_length()
        # The last generated token is never fed back, so the cache covers all but it.
        length = kv_len if kv_len is not None else sequences.shape[1] - 1
        if length <= 0:
            return
        batched = sequences.shape[0] > 1
        assert prompt_symbols is None or not batched, "media symbols are for one-row calls"
        for row, ids in enumerate(sequences[:, :length].tolist()):
            if prompt_symbols is not None:
                ids[: len(prompt_symbols)] = prompt_symbols[:length]
            self._store.insert_sequence(
                namespace,
                ids,
                cache,
                snapshots,
                row=row if batched else None,
                session=None if batched else session,
                items=() if batched else [s for s in items if s.length <= length],
                computed_from=computed_from,
            )

    # ----------------------------------------------------------- cache_params
    def _patch_prepare_inputs(self) -> None:
        """Models that take `cache_params` get full ids unsliced: skip what the working cache holds."""
        original = self._model.prepare_inputs_for_generation
        self._original_prepare = original
        self._outer_prepare = self._model.__dict__.get("prepare_inputs_for_generation")

        @functools.wraps(original)
        def prepare_inputs_for_generation(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            cache = kwargs.get("cache_params")
            if isinstance(cache, WorkingCache) and cache.skip_len:
                skip, cache.skip_len = cache.skip_len, None
                kwargs["next_sequence_length"] = input_ids.shape[1] - skip
                mask = kwargs.get("attention_mask")
                if mask is not None:
                    kwargs["attention_mask"] = mask[:, skip:]
            return original(input_ids, *args, **kwargs)

        self._model.prepare_inputs_for_generation = prepare_inputs_for_generation
        self._prepare_wrapper = prepare_inputs_for_generation


def _describe(model: Any) -> str:
    return f"{type(model).__name__} at {id(model):#x}"


def unwrap_session(given: Any) -> tuple[Session | None, Any]:
    """Split a passed `Session` into itself and its store; anything else passes as it is.

    Raises:
        ValueError: the session is closed.
    """
    if not isinstance(given, Session):
        return None, given
    if given.closed:
        raise ValueError(f"session {given.name!r} is closed; open a new one with store.session(name)")
    return given, given.store


def _common_prefix_len(rows: list[list[int]]) -> int:
    first = rows[0]
    n = len(first)
    for row in rows[1:]:
        i = 0
        while i < n and row[i] == first[i]:
            i += 1
        n = i
    return n


class GenerationSettings:
    """Reads a generation setting as `generate` will see it: kwarg, then the passed config, then the model's."""

    def __init__(self, model: Any, generation_config: Any, kwargs: dict[str, Any]) -> None:
        self._configs = [c for c in (generation_config, model.generation_config) if c is not None]
        self._passed = generation_config
        self._kwargs = kwargs

    def explicit(self, name: str) -> Any:
        """The setting if this call asked for it (kwarg or passed config), ignoring the model's defaults."""
        if name in self._kwargs:
            return self._kwargs[name]
        return getattr(self._passed, name, None)

    def __getattr__(self, name: str) -> Any:
        if name in self._kwargs:
            return self._kwargs[name]
        for config in self._configs:
            value = getattr(config, name, None)
            if value is not None:
                return value
        return None


def decoding_problem(config: GenerationSettings) -> str | None:
    """Why these decoding settings cannot run on one restored cache (beams, several sequences,
    no cache, assisted decoding), or None."""
    if (config.num_beams or 1) > 1:
        return "beam_search"
    if (config.num_return_sequences or 1) > 1:
        return "num_return_sequences"
    if config.use_cache is False:
        return "use_cache_false"
    if config.prompt_lookup_num_tokens is not None or config.assistant_early_exit is not None:
        return "assisted_decoding"
    return None


def _infers_padding(input_ids: torch.Tensor, config: Any) -> bool:
    """Whether transformers would infer an attention mask with zeros from pad tokens in the prompt."""
    pad, eos = config.pad_token_id, config.eos_token_id
    if pad is None:
        return False
    eos_ids = eos if isinstance(eos, list) else [eos]
    return pad not in eos_ids and bool((input_ids == pad).any())
