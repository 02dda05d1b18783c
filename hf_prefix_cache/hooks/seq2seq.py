"""Seq2SeqHook: encoder-decoder models that use `GenerationMixin.generate` as it is, keyed by the encoder input.

Served classes (BART, T5, mT5, Marian, Pegasus, Florence-2) are registered at the end of this module. The
hook acts at two levels, as `whisper.py` does:

1. Around `generate`: checks the call is one it can serve (otherwise the original runs cold
   with a named reason), hashes what feeds the encoder (`input_ids`, `attention_mask` with any
   padding in it, and Florence-2's `pixel_values`) and, when an encoder output is stored for
   that hash, passes it as `encoder_outputs` (the encoder does not run). The cache argument
   carries a `DecoderRequest` into `generate`.
2. Around `_prepare_decoder_input_ids_for_generation`, where `generate` has just built the
   decoder ids (the start token, prepended to the caller's `decoder_input_ids` if they lack
   it) and, on a miss, run the encoder: stores that encoder output, restores the decoder
   prefix matched in the namespace extended by the input hash, and hands `generate` a full
   `decoder_attention_mask` so that it feeds only the uncached ids (without a mask nothing is
   sliced and the output is wrong).

The finished decoder sequence is stored after `generate` returns. Knows nothing about the tree.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers.modeling_outputs import BaseModelOutput

from hf_prefix_cache import reasons
from hf_prefix_cache.errors import UnhashableMediaError
from hf_prefix_cache.hooks import checks, pipeline, refusals
from hf_prefix_cache.hooks.encoder_keyed import (
    DecoderRequest,
    keep_encoder_output,
    open_request,
    request_in,
    restore_into,
    store_decoder_rows,
)
from hf_prefix_cache.hooks.patching import PatchingHook
from hf_prefix_cache.hooks.registry import Family, register
from hf_prefix_cache.model import batch_rows
from hf_prefix_cache.multimodal.media import hash_media
from hf_prefix_cache.store.contract import Served, Serving, Store
from hf_prefix_cache.store.sessions import Session

# What feeds the encoder, in hashing order; pixel_values only where the model type merges images.
_ENCODER_KWARGS = ("input_ids", "attention_mask", "pixel_values")
_PIXEL_MODEL_TYPES = frozenset({"florence2"})
# Cache implementations served on the working cache (dropped from the call).
_SERVED_IMPLEMENTATIONS = frozenset({"dynamic"})
# Decoder-side model kwargs the hook handles itself.
_DECODER_KWARGS = frozenset({"decoder_input_ids", "decoder_attention_mask", "use_cache"})


@dataclass(slots=True)
class _Request(DecoderRequest):
    """A `DecoderRequest` that also says whether to keep the encoder output `generate` computes (a miss)."""

    keep_encoder: bool = field(default=False)
    prompt_len: int = field(default=0)
    expand: int = field(default=1)  # rows generate makes of the one decoder prompt (beams, several sequences)
    beams: bool = field(default=False)  # beam search: the returned rows are not the cache's rows
    decoder_ids: torch.Tensor | None = field(default=None)  # the decoder prompt generate built


class Seq2SeqHook(PatchingHook):
    """Serves `model.generate(input_ids, cache=store)` for the `seq2seq` encoder family."""

    def __init__(self, store: Store, model: Any, serving: Serving) -> None:
        super().__init__(store, model, serving)
        self._decoder_ids = self._patch("_prepare_decoder_input_ids_for_generation", self._prepare_decoder)
        model_type = getattr(model.config, "model_type", None)
        self._encoder_kwargs = tuple(
            name for name in _ENCODER_KWARGS if name != "pixel_values" or model_type in _PIXEL_MODEL_TYPES
        )

    # ----------------------------------------------------------------- outer call
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """One `generate` call: check, key, generate (its inner step restores), store (each step below)."""
        ours, session = pipeline.claim(self._store, self._model, kwargs, self._serving.serves_uncached)
        if not ours:
            return self._original(*args, **kwargs)
        bound, extra = pipeline.bind_call(self._signature, args, kwargs)
        if bound.arguments.get("inputs") is not None and "input_ids" not in extra:
            extra["input_ids"] = bound.arguments.pop("inputs")  # one name for the encoder's ids
        reason = self._check(bound.arguments, extra)
        digest = self._digest(extra) if reason is None else None
        if digest is None:
            reason = reason or reasons.UNHASHABLE_MEDIA
            return pipeline.run_cold(self._store, self._original, reason, _decoder_len(extra), args, kwargs)
        request = self._key(extra, digest, session)
        output = self._run(request, bound)
        return self._store_result(request, output)

    def _check(self, arguments: dict[str, Any], extra: dict[str, Any]) -> str | None:
        """Step 1, check: the reason this call cannot reuse safely, or None."""
        profile = self._profile
        if profile.unsupported is not None:
            return profile.unsupported
        refused = refusals.refused_argument({**extra, **arguments}, encoder_keyed=True)
        if refused is not None:
            return refused
        return (
            self._unknown_kwarg(arguments, extra)
            or self._inputs_problem(extra)
            or self._settings_problem(arguments, extra)
        )

    def _unknown_kwarg(self, arguments: dict[str, Any], extra: dict[str, Any]) -> str | None:
        """A model kwarg the hook does not know (generate hands those to the encoder or to every decoder step)."""
        configs = [c for c in (arguments.get("generation_config"), self._model.generation_config) if c is not None]
        for name, value in extra.items():
            if (
                value is None
                or name in self._encoder_kwargs
                or name in _DECODER_KWARGS
                or any(hasattr(c, name) for c in configs)
            ):
                continue  # generate reads a name its generation config has as a setting, not a model input
            # generate hands other model kwargs to the encoder (or to every decoder step): unknown effects.
            side = reasons.DECODER_KWARG if name.startswith(("decoder_", "cross_attn")) else reasons.ENCODER_KWARG
            return reasons.with_detail(side, name)
        return None

    def _inputs_problem(self, extra: dict[str, Any]) -> str | None:
        """What is wrong with the encoder's ids, mask and pixels or the decoder's ids and mask, if anything."""
        ids = extra.get("input_ids")
        problem = refusals.ids_problem(ids)
        if problem is not None:
            return problem
        assert isinstance(ids, torch.Tensor)
        if ids.shape[1] == 0:
            return reasons.EMPTY_PROMPT
        mask = extra.get("attention_mask")  # padding is hashed with the ids: only its shape matters
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != ids.shape):
            return reasons.ATTENTION_MASK_SHAPE
        pixels = extra.get("pixel_values")
        if isinstance(pixels, torch.Tensor) and pixels.shape[0] != 1:
            return reasons.BATCH_SIZE
        decoder_ids = extra.get("decoder_input_ids")
        if decoder_ids is not None and (problem := refusals.ids_problem(decoder_ids)) is not None:
            return problem
        decoder_mask = extra.get("decoder_attention_mask")
        if decoder_mask is not None:
            if decoder_ids is None:
                return reasons.ATTENTION_MASK_SHAPE
            return refusals.mask_problem(decoder_mask, decoder_ids)
        return None

    def _settings_problem(self, arguments: dict[str, Any], extra: dict[str, Any]) -> str | None:
        """A generation setting the hook cannot serve exactly, if any."""
        config = checks.GenerationSettings(self._model, arguments.get("generation_config"), extra)
        # A hit skips the encoder, so its attentions and hidden states would be missing.
        return (
            refusals.decoding_problem(config, refusals.Modes(expands=self._profile.expands))
            or refusals.cache_implementation_problem(config, _SERVED_IMPLEMENTATIONS)
            or refusals.output_problem(config)
        )

    def _digest(self, extra: dict[str, Any]) -> int | None:
        """The hash of what feeds the encoder: each encoder kwarg given, tagged by its name (None: unhashable)."""
        parts: list[Any] = []
        for name in self._encoder_kwargs:
            value = extra.get(name)
            if value is not None:
                parts += [np.frombuffer(name.encode(), dtype=np.uint8), value]
        try:
            return hash_media(*parts)
        except UnhashableMediaError:
            return None

    def _key(self, extra: dict[str, Any], digest: int, session: Session | None) -> _Request:
        """Step 2, key: the request of this encoder input; its stored encoder output, if any, replaces the encoder."""
        request, hidden = open_request(_Request, self._store, self._serving, digest, session)
        if hidden is None:
            request.keep_encoder = True  # generate runs the encoder; the inner step keeps its output
        else:
            extra["encoder_outputs"] = BaseModelOutput(last_hidden_state=hidden)
            extra.pop("pixel_values", None)  # merged into the stored output already
        return request

    def _run(self, request: _Request, bound: inspect.BoundArguments) -> Any:
        """Steps 3 and 4, restore and generate: the original `generate`, whose inner step restores the prefix."""
        store, extra = self._store, bound.arguments["kwargs"]
        extra[self._profile.cache_kwarg] = request
        settings = checks.GenerationSettings(self._model, bound.arguments.get("generation_config"), extra)
        request.expand, request.beams = refusals.expand_size(settings), (settings.num_beams or 1) > 1
        if settings.cache_implementation:
            # "dynamic" (or Gemma's default "hybrid"): our EncoderDecoderCache is one; transformers refuses both.
            extra[refusals.CACHE_IMPLEMENTATION] = None
        try:
            return self._original(*bound.args, **bound.kwargs)
        finally:
            if request.lease is not None:
                store.release(request.lease)

    # ----------------------------------------------------------------- inner call
    def _prepare_decoder(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """`generate`'s decoder ids, with the stored decoder prefix restored into the cache it will use."""
        decoder_ids, model_kwargs = self._decoder_ids.original(*args, **kwargs)
        request = request_in(_Request, self._store, model_kwargs)
        if request is None:
            return decoder_ids, model_kwargs  # not ours (another store's hook may sit below)
        assert not request.served, "one request reaches _prepare_decoder_input_ids_for_generation once"
        request.served = True
        if request.keep_encoder:
            keep_encoder_output(request, model_kwargs["encoder_outputs"].last_hidden_state)
        request.prompt_len, request.decoder_ids = int(decoder_ids.shape[-1]), decoder_ids
        # With a mask as long as the ids generate feeds only what the cache lacks (notes §2).
        restored = restore_into(request, decoder_ids, model_kwargs, request.expand)
        if restored and model_kwargs.get("decoder_attention_mask") is None:
            model_kwargs["decoder_attention_mask"] = torch.ones_like(decoder_ids)
        return decoder_ids, model_kwargs

    def _store_result(self, request: _Request, output: Any) -> Any:
        """Step 5, store: count the request and store its decoder sequence."""
        lease, working = request.lease, request.working
        if lease is None or working is None:
            return output  # counted already (out of memory)
        sequences = pipeline.sequences_of(output)
        self._store.record(Served(request.prompt_len, lease.cached_len))
        kv_len = working.kv_length()
        repeat = kv_len is not None and kv_len <= lease.matched_len and not working.profile.has_state
        if repeat and request.session is None:
            return output  # an exact repeat: the request added nothing to what it matched (and marked used)
        if request.beams:
            # As for decoder-only beams: the decoder prompt, once, from the first row.
            assert request.decoder_ids is not None
            batch_rows.trim(working, request.prompt_len, [0])
            sequences = request.decoder_ids
        store_decoder_rows(request, sequences, working)
        return output


def _decoder_len(extra: dict[str, Any]) -> int:
    """The length of the decoder prompt a call passed (0: none), as a cold run counts it."""
    ids = extra.get("decoder_input_ids")
    return ids.shape[-1] if isinstance(ids, torch.Tensor) else 0


#: The classes served, each tested against cold runs.
register(
    Family(
        "seq2seq",
        Seq2SeqHook,
        {
            "bart": "BartForConditionalGeneration",
            "t5": "T5ForConditionalGeneration",
            "mt5": "MT5ForConditionalGeneration",
            "marian": "MarianMTModel",
            "pegasus": "PegasusForConditionalGeneration",
            "florence2": "Florence2ForConditionalGeneration",
        },
    )
)
