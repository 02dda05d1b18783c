"""Seq2SeqHook: encoder-decoder models that use `GenerationMixin.generate` as it is, keyed by the encoder input.

Served classes (BART, T5, mT5, Marian, Pegasus, Florence-2) are registered at the end. To what
`encoder_keyed.py` does this module adds the check, the hash of what feeds the encoder (ids, mask
with any padding, Florence-2's `pixel_values`), and the inner step around
`_prepare_decoder_input_ids_for_generation`, where the decoder ids are known and, on a miss, the
encoder has run: its output is stored and the decoder prefix restored (`encoder_keyed.land`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers.modeling_outputs import BaseModelOutput

from hf_prefix_cache import reasons
from hf_prefix_cache.errors import InconsistentStateError, UnhashableMediaError
from hf_prefix_cache.hooks import checks, encoder_keyed, refusals
from hf_prefix_cache.hooks.encoder_keyed import DecoderRequest, EncoderCall, EncoderKeyedHook
from hf_prefix_cache.hooks.patching import Family, register
from hf_prefix_cache.multimodal.media import hash_media
from hf_prefix_cache.store.contract import Serving, Store

# What feeds the encoder, in hashing order; pixel_values only where the model type merges images.
_ENCODER_KWARGS = ("input_ids", "attention_mask", "pixel_values")
_PIXEL_MODEL_TYPES = frozenset({"florence2"})
# Cache implementations served on the working cache (dropped from the call).
_SERVED_IMPLEMENTATIONS = frozenset({"dynamic"})
# Decoder-side model kwargs the hook handles itself.
_DECODER_KWARGS = frozenset({"decoder_input_ids", "decoder_attention_mask", "use_cache"})


class Seq2SeqHook(EncoderKeyedHook):
    """Serves `model.generate(input_ids, cache=store)` for the `seq2seq` encoder family."""

    def __init__(self, store: Store, model: Any, serving: Serving) -> None:
        super().__init__(store, model, serving)
        self._decoder_ids = self._patch("_prepare_decoder_input_ids_for_generation", self._prepare_decoder)
        model_type = getattr(model.config, "model_type", None)
        self._encoder_kwargs = tuple(
            name for name in _ENCODER_KWARGS if name != "pixel_values" or model_type in _PIXEL_MODEL_TYPES
        )

    # ----------------------------------------------------------------- outer call
    def _arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        arguments = super()._arguments(args, kwargs)
        if arguments.get("inputs") is not None and "input_ids" not in arguments:
            arguments["input_ids"] = arguments.pop("inputs")  # one name for the encoder's ids
        return arguments

    def _problem(self, arguments: dict[str, Any]) -> str | None:
        """An unknown model kwarg, inputs or a setting this hook cannot serve exactly, if any."""
        problem = self._unknown_kwarg(arguments) or self._inputs_problem(arguments)
        if problem is not None:
            return problem
        settings = checks.GenerationSettings(self._model, arguments.get("generation_config"), arguments)
        # A hit skips the encoder, so its attentions and hidden states would be missing.
        return self._decoding_problem(settings, _SERVED_IMPLEMENTATIONS) or refusals.output_problem(settings)

    def _unknown_kwarg(self, arguments: dict[str, Any]) -> str | None:
        """A model kwarg the hook does not know: generate hands it to the encoder or every decoder step."""
        configs = [c for c in (arguments.get("generation_config"), self._model.generation_config) if c is not None]
        parameters = self._signature.parameters
        for name, value in arguments.items():
            if (
                value is None
                or name in parameters  # an argument of generate itself, not a model kwarg
                or name in self._encoder_kwargs
                or name in _DECODER_KWARGS
                or any(hasattr(c, name) for c in configs)
            ):
                continue  # generate reads a name its generation config has as a setting, not a model input
            side = reasons.DECODER_KWARG if name.startswith(("decoder_", "cross_attn")) else reasons.ENCODER_KWARG
            return reasons.with_detail(side, name)
        return None

    def _inputs_problem(self, arguments: dict[str, Any]) -> str | None:
        """What is wrong with the encoder's ids, mask and pixels or the decoder's ids and mask, if anything."""
        ids = arguments.get("input_ids")
        problem = checks.ids_problem(ids)  # each row is keyed alone
        if problem is not None or not isinstance(ids, torch.Tensor):
            return problem or reasons.NO_INPUT_IDS
        if ids.shape[1] == 0:
            return reasons.EMPTY_PROMPT
        mask = arguments.get("attention_mask")  # padding is hashed with the ids: only its shape matters
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != ids.shape):
            return reasons.ATTENTION_MASK_SHAPE
        pixels = arguments.get("pixel_values")
        if isinstance(pixels, torch.Tensor) and pixels.shape[0] != ids.shape[0]:
            return reasons.BATCH_SIZE
        decoder_ids = arguments.get("decoder_input_ids")
        if decoder_ids is not None and (problem := checks.ids_problem(decoder_ids)) is not None:
            return problem
        if decoder_ids is not None and decoder_ids.shape[0] != ids.shape[0]:
            return reasons.BATCH_SIZE
        decoder_mask = arguments.get("decoder_attention_mask")
        if decoder_mask is not None:
            if decoder_ids is None:
                return reasons.ATTENTION_MASK_SHAPE
            return refusals.mask_problem(decoder_mask, decoder_ids)
        return None

    def _digests(self, arguments: dict[str, Any]) -> tuple[int, ...] | None:
        """The hash of each row's encoder kwargs, each tagged by its name (None: unhashable)."""
        given = [(name, arguments[name]) for name in self._encoder_kwargs if arguments.get(name) is not None]
        tags = {name: np.frombuffer(name.encode(), dtype=np.uint8) for name, _ in given}  # hashed before the value
        try:
            return tuple(
                hash_media(*(part for name, value in given for part in (tags[name], value[i : i + 1])))
                for i in range(len(arguments["input_ids"]))
            )
        except UnhashableMediaError:
            return None

    def _cold_len(self, arguments: dict[str, Any]) -> int:
        """The length of the decoder prompt a call passed (0: none)."""
        ids = arguments.get("decoder_input_ids")
        return ids.shape[-1] if isinstance(ids, torch.Tensor) else 0

    def _arm(self, call: EncoderCall, request: DecoderRequest, hidden: torch.Tensor | None) -> None:
        """The stored encoder output for the encoder (a miss: the inner step keeps generate's), and the decoder rows."""
        kwargs = request.kwargs
        if hidden is None:
            request.keep_encoder = True
        else:
            kwargs["encoder_outputs"] = BaseModelOutput(last_hidden_state=hidden)
            kwargs.pop("pixel_values", None)  # merged into the stored output already
        settings = checks.GenerationSettings(self._model, kwargs.get("generation_config"), kwargs)
        request.expand, request.beams = settings.expand, (settings.num_beams or 1) > 1
        if settings.cache_implementation:
            # "dynamic" (or Gemma's default "hybrid"): our EncoderDecoderCache is one; transformers refuses both.
            kwargs[refusals.CACHE_IMPLEMENTATION] = None

    # ----------------------------------------------------------------- inner call
    def _prepare_decoder(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """`generate`'s decoder ids, with the stored decoder prefix restored into the cache it will use."""
        decoder_ids, model_kwargs = self._decoder_ids.original(*args, **kwargs)
        request = encoder_keyed.request_in(self._store, model_kwargs)
        if request is None:
            return decoder_ids, model_kwargs  # not ours (another store's hook may sit below)
        if request.landed:
            raise InconsistentStateError("one request reaches _prepare_decoder_input_ids_for_generation once")
        if request.keep_encoder:
            encoder_keyed.keep_encoder_output(request, model_kwargs["encoder_outputs"].last_hidden_state)
        encoder_keyed.land(request, decoder_ids, model_kwargs)
        if model_kwargs.get("decoder_attention_mask") is None:
            # With a mask as long as the ids generate feeds only what the cache lacks (without one nothing is sliced).
            model_kwargs["decoder_attention_mask"] = torch.ones_like(decoder_ids)
        return decoder_ids, model_kwargs


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
