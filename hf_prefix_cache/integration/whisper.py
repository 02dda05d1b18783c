"""WhisperHook: Whisper short-form generation keyed by the audio, with its encoder output reused.

`WhisperForConditionalGeneration.generate` builds the decoder prompt itself (start, language,
task and no-timestamps tokens, after any `prompt_ids`) and only then calls
`GenerationMixin.generate` from `generate_with_fallback`. So the hook acts at two levels:

1. Around `generate`: checks the call is one short-form clip it can serve (otherwise the
   original runs cold with a named reason), hashes the encoder input (`input_features`, and
   `attention_mask` if given) with `media.hash_media`, takes the encoder output stored for
   that hash or runs the encoder once and stores it (`encoder_decoder.EncoderOutputs`), and
   calls the original with `encoder_outputs` in place of `input_features` (the same tensor
   transformers would compute; language detection uses it too). `past_key_values` carries a
   `DecoderRequest` down to the inner call.
2. Around `generate_with_fallback`, where the decoder ids are known: matches them in a tree
   namespace extended by the audio hash (another audio never shares decoder states, since
   every decoder position attends to the audio), restores the matched decoder self-attention
   prefix into an `EncoderDecoderCache` whose cross-attention part starts empty (transformers
   fills it from this request's encoder output on the first step), and stores the finished
   decoder sequence.

The hashing namespace, encoder-output store and decoder restore are `encoder_keyed.py`'s.
Both patches are instance attributes, removed by `detach`. Knows nothing about the tree.
"""

from __future__ import annotations

import inspect
import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import BaseModelOutput

from hf_prefix_cache.integration.encoder_keyed import DecoderRequest, EncoderKeyedHook, encoder_namespace
from hf_prefix_cache.integration.generate_hook import GenerationSettings, decoding_problem, unwrap_session
from hf_prefix_cache.multimodal.media import hash_media

if TYPE_CHECKING:
    from hf_prefix_cache.store.tree_store import PrefixCache

logger = logging.getLogger("hf_prefix_cache")

# Generate arguments the hook does not serve, each with the fallback reason it counts.
_REFUSED_ARGUMENTS = (
    ("encoder_outputs", "encoder_outputs"),
    ("inputs_embeds", "inputs_embeds"),
    ("decoder_inputs_embeds", "inputs_embeds"),
    ("decoder_position_ids", "explicit_position_ids"),
    ("position_ids", "explicit_position_ids"),
    ("assistant_model", "assisted_decoding"),
    ("custom_generate", "custom_generate"),
)
# Settings (argument, passed config or model config) that make reuse inexact, each with its reason.
_REFUSED_SETTINGS = (
    ("return_timestamps", "return_timestamps"),  # may loop over several windows of one clip
    ("return_token_timestamps", "return_token_timestamps"),
    ("output_attentions", "output_attentions"),  # would include the encoder's, which a hit skips
    ("output_hidden_states", "output_hidden_states"),
    ("no_speech_threshold", "no_speech_threshold"),  # its detector reruns the model on input_features
    ("prompt_lookup_num_tokens", "assisted_decoding"),
    ("assistant_early_exit", "assisted_decoding"),
)


class WhisperHook(EncoderKeyedHook):
    """Serves `WhisperForConditionalGeneration.generate(input_features, past_key_values=store)`."""

    def __init__(self, store: PrefixCache, model: Any) -> None:
        super().__init__(store, model)
        self._original_segment = self._wrap_inner("generate_with_fallback", self._serve_segment)
        self._segment_signature = inspect.signature(self._original_segment)
        encoder = model.get_encoder()
        # Whisper pads every clip to this many mel frames; longer input is long-form.
        self._num_frames = int(encoder.conv1.stride[0] * encoder.conv2.stride[0] * model.config.max_source_positions)

    # ----------------------------------------------------------------- outer call
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        store = self._store
        session, given = unwrap_session(kwargs.get("past_key_values"))
        if given is not store:
            return super().__call__(*args, **kwargs)  # not ours: passes through, or raises for another store
        kwargs.pop("past_key_values")
        bound = self._signature.bind_partial(*args, **kwargs)
        extra = bound.arguments.setdefault("kwargs", {})
        call = {**extra, **{k: v for k, v in bound.arguments.items() if k != "kwargs"}}
        features, mask = call.get("input_features"), call.get("attention_mask")
        reason = self._why_cold_whisper(features, call)
        if reason is not None:
            store.count_fallback(reason, 0)
            return self._original(*args, **kwargs)
        assert isinstance(features, torch.Tensor)
        digest = hash_media(features) if mask is None else hash_media(features, mask)
        namespace = store.namespace()
        hidden = store.encoder_outputs.get(namespace, digest)
        if hidden is None:
            hidden = self._encode(features, mask)
            self._keep_encoder_output(namespace, digest, hidden)
        bound.arguments["input_features"] = None
        extra["encoder_outputs"] = BaseModelOutput(last_hidden_state=hidden)
        # The decoder attends to the audio at every position: its states are only shared for the same audio.
        request = DecoderRequest(store, encoder_namespace(namespace, digest), session)
        extra["past_key_values"] = request
        try:
            output = self._original(*bound.args, **bound.kwargs)
        except _AnotherSegment:
            # What the first segment stored is exact (it saw the clip's first window, as a cold run does).
            store.count_fallback("whisper_segments", 0)
            return self._original(*args, **kwargs)
        if request.counted is not None:
            store.count_request(*request.counted)
        return output

    def _encode(self, features: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The encoder output `generate` would compute: the clip zero-padded to the window, as Whisper pads it."""
        if features.shape[-1] < self._num_frames:
            features = F.pad(features, (0, self._num_frames - features.shape[-1]))
        with torch.no_grad():
            out = self._model.get_encoder()(input_features=features, attention_mask=mask, return_dict=True)
        hidden: torch.Tensor = out.last_hidden_state
        return hidden

    def _why_cold_whisper(self, features: Any, call: dict[str, Any]) -> str | None:
        """Name the reason this call cannot reuse safely, or None."""
        store = self._store
        if store.profile.unsupported is not None:
            return store.profile.unsupported
        for name, reason in _REFUSED_ARGUMENTS:
            if call.get(name) is not None:
                return reason
        if not isinstance(features, torch.Tensor) or features.dim() != 3 or not features.is_floating_point():
            return "no_input_features"
        if features.shape[0] != 1:
            return "batch_size"
        if features.shape[-1] > self._num_frames:
            return "long_form"
        if features.shape[-1] < self._num_frames:
            # Whisper reports segment times and progress from the unpadded frame count, a hit's encoder output has none.
            for name in ("return_segments", "monitor_progress"):
                if call.get(name):
                    return name
        mask = call.get("attention_mask")
        if mask is not None and not isinstance(mask, torch.Tensor):
            return "unhashable_media"
        # As Whisper reads a setting: an argument given (not None), then the passed config, then the model's.
        given = {name: value for name, value in call.items() if value is not None}
        setting = GenerationSettings(self._model, call.get("generation_config"), given)
        for name, reason in _REFUSED_SETTINGS:
            if getattr(setting, name):
                return reason
        temperature = call.get("temperature")
        if isinstance(temperature, (list, tuple)) and len(temperature) > 1:
            return "temperature_fallback"  # several generate calls on one request
        problem = decoding_problem(setting)
        if problem is not None:
            return problem
        # transformers refuses a passed cache next to any cache_implementation but a default "hybrid", which it unsets.
        asked = setting.cache_implementation
        if asked is not None and asked != "hybrid":
            return f"cache_implementation:{asked}"
        ids = call.get("decoder_input_ids")
        if ids is not None and (not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1):
            return "batch_size" if isinstance(ids, torch.Tensor) and ids.dim() == 2 else "no_input_ids"
        return None

    # ----------------------------------------------------------------- inner call
    def _serve_segment(self, *args: Any, **kwargs: Any) -> Any:
        """`generate_with_fallback` with the decoder prefix restored from, and the result stored in, the store."""
        bound = self._segment_signature.bind(*args, **kwargs)
        inner = dict(bound.arguments["kwargs"])
        request = inner.get("past_key_values")
        if not isinstance(request, DecoderRequest) or request.store is not self._store:
            return self._original_segment(*args, **kwargs)  # not ours (another store's hook may sit below)
        store = self._store
        if request.served:
            # Whisper loops into another segment when one did not reach the clip's end. That segment's
            # encoder input is a later window, not the stored encoder output: give up and rerun cold.
            raise _AnotherSegment
        request.served = True
        bound.arguments["kwargs"] = inner
        ids: torch.Tensor = bound.arguments["decoder_input_ids"]
        rows = ids.tolist()
        mask = inner.get("decoder_attention_mask")
        if mask is not None and (mask.shape != ids.shape or not bool((mask == 1).all())):
            inner.pop("past_key_values")
            store.count_fallback("padding", len(rows[0]))
            return self._original_segment(*bound.args, **bound.kwargs)
        restored = self._restore_decoder(request.namespace, ids)
        if restored is None:
            inner.pop("past_key_values")
            store.count_fallback("out_of_memory", len(rows[0]))
            return self._original_segment(*bound.args, **bound.kwargs)
        plan, working, inner["past_key_values"] = restored
        # Whisper sets this itself only without an attention_mask; it makes generate feed just the uncached ids.
        bound.arguments["generation_config"]._mask_length = ids.shape[-1]
        try:
            output = self._original_segment(*bound.args, **bound.kwargs)
        finally:
            store.release(plan)
        request.counted = (len(rows[0]), plan.restore_len)  # by the outer call, once it knows the request ends here
        sequence = _full_sequence(output[1][0])
        kv_len = working.kv_length()
        if sequence is not None and kv_len is not None and sequence.shape[-1] == kv_len + 1:
            self._store_result(request.namespace, sequence.reshape(1, -1), working, [], None, request.session)
        else:
            logger.warning("whisper output does not match its cache (%s vs %s); not stored", sequence, kv_len)
        return output


class _AnotherSegment(Exception):
    """Whisper reached `generate_with_fallback` a second time in one request."""


def _full_sequence(segment_output: Any) -> torch.Tensor | None:
    """The decoder ids `GenerationMixin.generate` returned for the one row (prompt included)."""
    if isinstance(segment_output, torch.Tensor):
        return segment_output
    sequences = segment_output.get("sequences") if isinstance(segment_output, dict) else None
    return sequences if isinstance(sequences, torch.Tensor) else None
