"""Seq2SeqHook: encoder-decoder models that use `GenerationMixin.generate` as it is, keyed by the encoder input.

Served classes (BART, T5, mT5, Marian, Pegasus, Florence-2) are listed in `profile.py`. The
hook acts at two levels, as `whisper.py` does:

1. Around `generate`: checks the call is one it can serve (otherwise the original runs cold
   with a named reason), hashes what feeds the encoder (`input_ids`, `attention_mask` with any
   padding in it, and Florence-2's `pixel_values`) and, when an encoder output is stored for
   that hash, passes it as `encoder_outputs` (the encoder does not run). `past_key_values`
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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers.modeling_outputs import BaseModelOutput

from hf_prefix_cache.errors import UnhashableMediaError
from hf_prefix_cache.integration.encoder_keyed import DecoderRequest, EncoderKeyedHook, encoder_namespace
from hf_prefix_cache.integration.generate_hook import GenerationSettings, decoding_problem, unwrap_session
from hf_prefix_cache.multimodal.media import hash_media

if TYPE_CHECKING:
    from hf_prefix_cache.store.tree_store import PrefixCache

# What feeds the encoder, in hashing order; pixel_values only where the model type merges images.
_ENCODER_KWARGS = ("input_ids", "attention_mask", "pixel_values")
_PIXEL_MODEL_TYPES = frozenset({"florence2"})
# Decoder-side model kwargs the hook handles itself.
_DECODER_KWARGS = frozenset({"decoder_input_ids", "decoder_attention_mask", "use_cache"})
# Generate arguments the hook does not serve, each with the fallback reason it counts.
_REFUSED_ARGUMENTS = (
    ("encoder_outputs", "encoder_outputs"),
    ("inputs_embeds", "inputs_embeds"),
    ("decoder_inputs_embeds", "inputs_embeds"),
    ("decoder_position_ids", "explicit_position_ids"),
    ("position_ids", "explicit_position_ids"),
    ("assistant_model", "assisted_decoding"),
    ("custom_generate", "custom_generate"),
    ("negative_prompt_ids", "negative_prompt"),
)


@dataclass(slots=True)
class _Request(DecoderRequest):
    """A `DecoderRequest` that also says where to store an encoder output computed by `generate` (a miss)."""

    encoder_key: tuple[str, int] | None = field(default=None)
    prompt_len: int = field(default=0)


class Seq2SeqHook(EncoderKeyedHook):
    """Serves `model.generate(input_ids, past_key_values=store)` for the `seq2seq` encoder family."""

    def __init__(self, store: PrefixCache, model: Any) -> None:
        super().__init__(store, model)
        self._original_decoder_ids = self._wrap_inner(
            "_prepare_decoder_input_ids_for_generation", self._prepare_decoder
        )
        model_type = getattr(model.config, "model_type", None)
        self._encoder_kwargs = tuple(
            name for name in _ENCODER_KWARGS if name != "pixel_values" or model_type in _PIXEL_MODEL_TYPES
        )

    # ----------------------------------------------------------------- outer call
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        store = self._store
        session, given = unwrap_session(kwargs.get("past_key_values"))
        if given is not store:
            return super().__call__(*args, **kwargs)  # not ours: passes through, or raises for another store
        kwargs.pop("past_key_values")
        bound = self._signature.bind_partial(*args, **kwargs)
        extra = bound.arguments.setdefault("kwargs", {})
        if bound.arguments.get("inputs") is not None and "input_ids" not in extra:
            extra["input_ids"] = bound.arguments.pop("inputs")  # one name for the encoder's ids
        reason = self._why_cold_seq2seq(bound.arguments, extra)
        digest = None
        if reason is None:
            try:
                digest = hash_media(*self._encoder_parts(extra))
            except UnhashableMediaError:
                reason = "unhashable_media"
        if reason is not None or digest is None:
            ids = extra.get("decoder_input_ids")
            store.count_fallback(reason or "unhashable_media", ids.shape[-1] if isinstance(ids, torch.Tensor) else 0)
            return self._original(*args, **kwargs)
        namespace = store.namespace()
        request = _Request(store, encoder_namespace(namespace, digest), session)
        hidden = store.encoder_outputs.get(namespace, digest)
        if hidden is None:
            request.encoder_key = (namespace, digest)  # generate runs the encoder; the inner step keeps its output
        else:
            extra["encoder_outputs"] = BaseModelOutput(last_hidden_state=hidden)
            extra.pop("pixel_values", None)  # merged into the stored output already
        extra["past_key_values"] = request
        try:
            output = self._original(*bound.args, **bound.kwargs)
        finally:
            if request.plan is not None:
                store.release(request.plan)
        return self._finish(request, output)

    def _encoder_parts(self, extra: dict[str, Any]) -> list[Any]:
        """What `hash_media` hashes: each encoder kwarg given, tagged by its name."""
        parts: list[Any] = []
        for name in self._encoder_kwargs:
            value = extra.get(name)
            if value is not None:
                parts += [np.frombuffer(name.encode(), dtype=np.uint8), value]
        return parts

    def _why_cold_seq2seq(self, arguments: dict[str, Any], extra: dict[str, Any]) -> str | None:
        """Name the reason this call cannot reuse safely, or None."""
        store = self._store
        if store.profile.unsupported is not None:
            return store.profile.unsupported
        for name, reason in _REFUSED_ARGUMENTS:
            if arguments.get(name) is not None or extra.get(name) is not None:
                return reason
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
            side = "decoder" if name.startswith(("decoder_", "cross_attn")) else "encoder"
            return f"{side}_kwarg:{name}"
        ids = extra.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
            return "no_input_ids"
        if ids.shape[0] != 1:
            return "batch_size"
        if ids.shape[1] == 0:
            return "empty_prompt"
        mask = extra.get("attention_mask")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != ids.shape):
            return "attention_mask_shape"
        pixels = extra.get("pixel_values")
        if isinstance(pixels, torch.Tensor) and pixels.shape[0] != 1:
            return "batch_size"
        decoder_ids = extra.get("decoder_input_ids")
        if decoder_ids is not None:
            if not isinstance(decoder_ids, torch.Tensor) or decoder_ids.dim() != 2 or decoder_ids.is_floating_point():
                return "no_input_ids"
            if decoder_ids.shape[0] != 1:
                return "batch_size"
        decoder_mask = extra.get("decoder_attention_mask")
        if decoder_mask is not None:
            if decoder_ids is None or decoder_mask.shape != decoder_ids.shape:
                return "attention_mask_shape"
            if not bool((decoder_mask == 1).all()):
                return "padding"
        config = GenerationSettings(self._model, arguments.get("generation_config"), extra)
        problem = decoding_problem(config)
        if problem is not None:
            return problem
        # transformers refuses a passed cache beside any cache_implementation, the model's default included;
        # Gemma-style default "hybrid" yields to it.
        impl = config.cache_implementation
        if impl is not None and not (impl == "hybrid" and config.explicit("cache_implementation") is None):
            return f"cache_implementation:{impl}"
        # A hit skips the encoder, so its attentions and hidden states would be missing.
        if config.output_attentions or config.output_hidden_states:
            return "output_attentions" if config.output_attentions else "output_hidden_states"
        return None

    # ----------------------------------------------------------------- inner call
    def _prepare_decoder(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """`generate`'s decoder ids, with the stored decoder prefix restored into the cache it will use."""
        decoder_ids, model_kwargs = self._original_decoder_ids(*args, **kwargs)
        request = model_kwargs.get("past_key_values")
        if not isinstance(request, _Request) or request.store is not self._store:
            return decoder_ids, model_kwargs  # not ours (another store's hook may sit below)
        assert not request.served, "one request reaches _prepare_decoder_input_ids_for_generation once"
        request.served = True
        if request.encoder_key is not None:
            self._keep_encoder_output(*request.encoder_key, model_kwargs["encoder_outputs"].last_hidden_state)
        request.prompt_len = int(decoder_ids.shape[-1])
        restored = self._restore_decoder(request.namespace, decoder_ids)
        if restored is None:
            model_kwargs.pop("past_key_values")
            self._store.count_fallback("out_of_memory", request.prompt_len)
            return decoder_ids, model_kwargs
        request.plan, request.working, model_kwargs["past_key_values"] = restored
        # With a mask as long as the ids generate feeds only what the cache lacks (notes §2).
        if model_kwargs.get("decoder_attention_mask") is None:
            model_kwargs["decoder_attention_mask"] = torch.ones_like(decoder_ids)
        return decoder_ids, model_kwargs

    def _finish(self, request: _Request, output: Any) -> Any:
        """Count the request and store its decoder sequence."""
        plan, working = request.plan, request.working
        if plan is None or working is None:
            return output  # counted already (out of memory)
        sequences = output if isinstance(output, torch.Tensor) else output.sequences
        self._store.count_request(request.prompt_len, plan.restore_len)
        kv_len = working.kv_length()
        if kv_len is not None and kv_len <= plan.matched_len and request.session is None:
            return output  # an exact repeat: all of it was matched (and marked used) when acquired
        self._store_result(request.namespace, sequences, working, [], None, request.session)
        return output
