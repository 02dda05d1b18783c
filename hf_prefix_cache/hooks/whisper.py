"""WhisperHook: Whisper short-form generation keyed by the audio, with its encoder output reused.

Whisper's `generate` builds the decoder prompt itself, then calls `GenerationMixin.generate` from
`generate_with_fallback`. To what `encoder_keyed.py` does this module adds the check (one
short-form clip), the hash of the audio, the encoder output passed as `encoder_outputs` (stored,
or computed once and stored), and the inner step around `generate_with_fallback`, where the
decoder ids are known. A clip that loops into a second window runs cold, from its first random state.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import BaseModelOutput

from hf_prefix_cache import reasons
from hf_prefix_cache.hooks import checks, encoder_keyed, pipeline, refusals
from hf_prefix_cache.hooks.encoder_keyed import DecoderRequest, EncoderCall, EncoderKeyedHook
from hf_prefix_cache.hooks.patching import Family, register
from hf_prefix_cache.multimodal.media import hash_media
from hf_prefix_cache.store.contract import Serving, Store

# Settings (argument, passed config or model config) that make reuse inexact, each with its reason.
_REFUSED_SETTINGS: Mapping[str, str] = {
    "return_timestamps": reasons.RETURN_TIMESTAMPS,  # may loop over several windows of one clip
    "return_token_timestamps": reasons.RETURN_TOKEN_TIMESTAMPS,
    "output_attentions": reasons.OUTPUT_ATTENTIONS,  # would include the encoder's, which a hit skips
    "output_hidden_states": reasons.OUTPUT_HIDDEN_STATES,
    "no_speech_threshold": reasons.NO_SPEECH_THRESHOLD,  # its detector reruns the model on input_features
}
# Whisper's decoding settings: a model-default or explicit "hybrid" is unset by Whisper itself.
_SERVED_IMPLEMENTATIONS = frozenset({"hybrid"})


class WhisperHook(EncoderKeyedHook):
    """Serves `WhisperForConditionalGeneration.generate(input_features, cache=store)`."""

    def __init__(self, store: Store, model: Any, serving: Serving) -> None:
        super().__init__(store, model, serving)
        self._segment = self._patch("generate_with_fallback", self._serve_segment)
        self._reduce = self._patch("_maybe_reduce_batch", self._next_segment)
        self._request: DecoderRequest | None = None  # the request served, while its generate runs
        self._segment_signature = inspect.signature(self._segment.original)
        encoder = model.get_encoder()
        # Whisper pads every clip to this many mel frames; longer input is long-form.
        self._num_frames = int(encoder.conv1.stride[0] * encoder.conv2.stride[0] * model.config.max_source_positions)

    # ----------------------------------------------------------------- outer call
    def _digests(self, arguments: dict[str, Any]) -> tuple[int, ...] | None:
        """The hash of each clip: its features, and their mask if given."""
        features, mask = arguments["input_features"], arguments.get("attention_mask")
        rows = [slice(i, i + 1) for i in range(len(features))]
        return tuple(hash_media(features[r]) if mask is None else hash_media(features[r], mask[r]) for r in rows)

    def _arm(self, call: EncoderCall, request: DecoderRequest, hidden: torch.Tensor | None) -> None:
        """The audio's encoder output (stored, or computed now and stored) in place of `input_features`.

        Whisper makes several returned sequences by copying the clip's features and decoding one sequence
        each; it cannot copy an encoder output, so the call passes the copies (views) and asks for one each.
        """
        kwargs = request.kwargs
        if hidden is None:
            hidden = self._encode(kwargs["input_features"], kwargs.get("attention_mask"))
            encoder_keyed.keep_encoder_output(request, hidden)
        kwargs["input_features"] = None
        settings = checks.GenerationSettings(self._model, kwargs.get("generation_config"), kwargs)
        copies = settings.num_return_sequences or 1
        if copies > 1:
            # Whisper repeats each clip's rows in place (`repeat_interleave`); one clip's as views.
            hidden = hidden.expand(copies, -1, -1) if len(hidden) == 1 else hidden.repeat_interleave(copies, dim=0)
            kwargs["num_return_sequences"] = 1
        kwargs["encoder_outputs"] = BaseModelOutput(last_hidden_state=hidden)
        # A cold rerun (the clip needed a second window) draws what the cold call draws.
        request.reset = _rng_reset(self._model.device)

    def _generate(self, *args: Any, **kwargs: Any) -> Any:
        """Whisper's `generate`, served or cold; the request it served is forgotten when it ends."""
        try:
            return self._original(*args, **kwargs)
        finally:
            self._request = None

    def _rows(self, request: DecoderRequest, output: Any) -> torch.Tensor | None:
        """Each row's decoder ids as `GenerationMixin.generate` returned them to its segment (prompt included), when
        they are what the cache holds plus one token."""
        kv_len = request.working.kv_length() if request.working is not None else None
        rows = []
        for row in request.finished:
            row = row.get("sequences") if isinstance(row, dict) else row
            if not isinstance(row, torch.Tensor) or kv_len is None or row.shape[-1] != kv_len + 1:
                return None
            rows.append(row.reshape(-1))
        return torch.stack(rows)

    def _encode(self, features: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The encoder output `generate` would compute: the clip zero-padded to the window, as Whisper pads it."""
        if features.shape[-1] < self._num_frames:
            features = F.pad(features, (0, self._num_frames - features.shape[-1]))
        with torch.no_grad():
            out = self._model.get_encoder()(input_features=features, attention_mask=mask, return_dict=True)
        hidden: torch.Tensor = out.last_hidden_state
        return hidden

    def _problem(self, call: dict[str, Any]) -> str | None:
        """What keeps the call from being one short-form clip to hash with settings served exactly, if anything."""
        features = call.get("input_features")
        if not isinstance(features, torch.Tensor) or features.dim() != 3 or not features.is_floating_point():
            return reasons.NO_INPUT_FEATURES
        if features.shape[-1] > self._num_frames:
            return reasons.LONG_FORM
        if features.shape[-1] < self._num_frames:
            # Whisper reports segment times and progress from the unpadded frame count, a hit's encoder output has none.
            if call.get("return_segments"):
                return reasons.RETURN_SEGMENTS
            if call.get("monitor_progress"):
                return reasons.MONITOR_PROGRESS
        mask = call.get("attention_mask")
        if mask is not None and not isinstance(mask, torch.Tensor):
            return reasons.UNHASHABLE_MEDIA
        return self._settings_problem(call)

    def _settings_problem(self, call: dict[str, Any]) -> str | None:
        """A setting (or decoder prompt) the hook cannot serve exactly, if any."""
        # As Whisper reads a setting: an argument given (not None), then the passed config, then the model's.
        given = {name: value for name, value in call.items() if value is not None}
        setting = checks.GenerationSettings(self._model, call.get("generation_config"), given)
        for name, reason in _REFUSED_SETTINGS.items():
            if getattr(setting, name):
                return reason
        temperature = call.get("temperature")
        if isinstance(temperature, (list, tuple)) and len(temperature) > 1:
            return reasons.TEMPERATURE_FALLBACK  # several generate calls on one request
        problem = self._decoding_problem(setting, _SERVED_IMPLEMENTATIONS)
        ids = call.get("decoder_input_ids")
        return problem or (checks.ids_problem(ids, one_row=True) if ids is not None else None)

    # ----------------------------------------------------------------- inner call
    def _serve_segment(self, *args: Any, **kwargs: Any) -> Any:
        """`generate_with_fallback` with the decoder prefix restored (`encoder_keyed.land`); its rows kept to store."""
        bound = self._segment_signature.bind(*args, **kwargs)
        inner = dict(bound.arguments["kwargs"])
        request = encoder_keyed.request_in(self._store, inner)
        if request is None:
            return self._segment.original(*args, **kwargs)  # not ours (another store's hook may sit below)
        ids: torch.Tensor = bound.arguments["decoder_input_ids"]
        if request.landed:
            # Whisper loops into another segment when one did not reach the clip's end. That segment's
            # encoder input is a later window, not the stored encoder output: give up and rerun cold.
            raise pipeline.RunCold(pipeline.Cold(reasons.WHISPER_SEGMENTS), 0, request.reset)
        if refusals.mask_problem(inner.get("decoder_attention_mask"), ids) is not None:
            raise pipeline.RunCold(pipeline.Cold(reasons.PADDING), int(ids.shape[-1]))
        # Whisper samples (without beams) when its one temperature is above 0, whatever `do_sample` says.
        temperature = bound.arguments["temperatures"][0]
        sampled = temperature is not None and temperature > 0.0
        request.expand = 1 if sampled else bound.arguments["generation_config"].num_beams or 1
        request.beams = request.expand > 1
        self._request = request
        encoder_keyed.land(request, ids, inner)
        bound.arguments["kwargs"] = inner
        # Whisper sets this itself only without an attention_mask; it makes generate feed just the uncached ids.
        bound.arguments["generation_config"]._mask_length = ids.shape[-1]
        output = self._segment.original(*bound.args, **bound.kwargs)
        request.finished = output[1]
        return output

    def _next_segment(self, *args: Any, **kwargs: Any) -> Any:
        """Whisper's loop over the clip's windows: past the served first segment, give up (rerun cold): Whisper
        would cut rows that need no other segment out of `input_features`, which a served call does not pass."""
        request = self._request
        if request is not None and request.landed:
            raise pipeline.RunCold(pipeline.Cold(reasons.WHISPER_SEGMENTS), 0, request.reset)
        return self._reduce.original(*args, **kwargs)


def _rng_reset(device: torch.device) -> Callable[[], None]:
    """What puts back the generators sampling draws from as they are now: the CPU's, and `device`'s if CUDA."""
    cpu, cuda = torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def reset() -> None:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)

    return reset


register(Family("whisper", WhisperHook, {"whisper": "WhisperForConditionalGeneration"}))
