"""WhisperHook: Whisper short-form generation keyed by the audio, with its encoder output reused.

`WhisperForConditionalGeneration.generate` builds the decoder prompt itself (start, language,
task and no-timestamps tokens, after any `prompt_ids`) and only then calls
`GenerationMixin.generate` from `generate_with_fallback`. So the hook acts at two levels:

1. Around `generate`: checks the call is one short-form clip it can serve (otherwise the
   original runs cold with a named reason), hashes the encoder input (`input_features`, and
   `attention_mask` if given) with `media.hash_media`, takes the encoder output stored for
   that hash or runs the encoder once and stores it (`encoder_decoder.EncoderOutputs`), and
   calls the original with `encoder_outputs` in place of `input_features` (the same tensor
   transformers would compute; language detection uses it too). The cache argument carries a
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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import BaseModelOutput

from hf_prefix_cache import _compat, reasons
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
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.multimodal.media import hash_media
from hf_prefix_cache.store.contract import Fallback, Served, Serving, Store
from hf_prefix_cache.store.sessions import Session

logger = logging.getLogger("hf_prefix_cache")

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


@dataclass(slots=True)
class _Request(DecoderRequest):
    """A `DecoderRequest` that also says how `generate` copies the decoder prompt (beams, several sequences)."""

    expand: int = field(default=1)  # rows generate makes of each decoder prompt row: beams
    beams: bool = field(default=False)  # beam search: the returned rows are not the cache's rows


class WhisperHook(PatchingHook):
    """Serves `WhisperForConditionalGeneration.generate(input_features, cache=store)`."""

    def __init__(self, store: Store, model: Any, serving: Serving) -> None:
        super().__init__(store, model, serving)
        self._segment = self._patch("generate_with_fallback", self._serve_segment)
        self._reduce = self._patch("_maybe_reduce_batch", self._next_segment)
        self._request: _Request | None = None  # the request being served, while its generate runs
        self._segment_signature = inspect.signature(self._segment.original)
        encoder = model.get_encoder()
        # Whisper pads every clip to this many mel frames; longer input is long-form.
        self._num_frames = int(encoder.conv1.stride[0] * encoder.conv2.stride[0] * model.config.max_source_positions)

    # ----------------------------------------------------------------- outer call
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """One `generate` call: check, key, then restore, generate and store (`_run`; each step below)."""
        ours, session = pipeline.claim(self._store, self._model, kwargs, self._serving.serves_uncached)
        if not ours:
            return self._original(*args, **kwargs)
        bound, extra = pipeline.bind_call(self._signature, args, kwargs)
        call = {**extra, **{k: v for k, v in bound.arguments.items() if k != "kwargs"}}
        reason = self._check(call.get("input_features"), call)
        if reason is not None:
            return pipeline.run_cold(self._store, self._original, reason, 0, args, kwargs)
        request = self._key(bound, call, session)
        return self._run(request, bound, args, kwargs)

    def _key(self, bound: inspect.BoundArguments, call: dict[str, Any], session: Session | None) -> _Request:
        """Step 2, key: the request of this audio, whose encoder output (stored, or computed now and stored) the
        call passes in place of `input_features`.

        Several returned sequences: Whisper copies the clip's features (and decoder prompt) that many
        times itself, then decodes them as a batch of one sequence each; it cannot copy an encoder
        output, so the call passes the copies (views of one output) and asks for one sequence each.
        """
        extra = bound.arguments["kwargs"]
        features, mask = call["input_features"], call.get("attention_mask")
        digest = hash_media(features) if mask is None else hash_media(features, mask)
        # The decoder attends to the audio at every position: its states are only shared for the same audio.
        request, hidden = open_request(_Request, self._store, self._serving, digest, session)
        if hidden is None:
            hidden = self._encode(features, mask)
            keep_encoder_output(request, hidden)
        bound.arguments["input_features"] = None
        settings = checks.GenerationSettings(self._model, call.get("generation_config"), extra)
        copies = settings.num_return_sequences or 1
        if copies > 1:
            hidden = hidden.expand(copies, -1, -1)
            extra["num_return_sequences"] = 1
        extra["encoder_outputs"] = BaseModelOutput(last_hidden_state=hidden)
        extra[self._profile.cache_kwarg] = request
        return request

    def _run(
        self, request: _Request, bound: inspect.BoundArguments, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Steps 3 to 5, restore, generate and store: the original `generate`, whose inner step does all three,
        then the request counted; a clip that needs a second segment reruns cold (`args`, `kwargs` as called)."""
        self._request, rng = request, _rng_state(self._model.device)
        try:
            output = self._original(*bound.args, **bound.kwargs)
        except _AnotherSegment:
            # What the first segment stored is exact (it saw the clip's first window, as a cold run does).
            self._store.record(Fallback(reasons.WHISPER_SEGMENTS, 0))
            self._request = None
            _set_rng_state(self._model.device, rng)  # a sampled rerun draws what the cold call draws
            return self._original(*args, **kwargs)
        finally:
            self._request = None
        if request.counted is not None:
            self._store.record(request.counted)
        return output

    def _encode(self, features: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The encoder output `generate` would compute: the clip zero-padded to the window, as Whisper pads it."""
        if features.shape[-1] < self._num_frames:
            features = F.pad(features, (0, self._num_frames - features.shape[-1]))
        with torch.no_grad():
            out = self._model.get_encoder()(input_features=features, attention_mask=mask, return_dict=True)
        hidden: torch.Tensor = out.last_hidden_state
        return hidden

    def _check(self, features: Any, call: dict[str, Any]) -> str | None:
        """Step 1, check: the reason this call cannot reuse safely, or None."""
        profile = self._profile
        if profile.unsupported is not None:
            return profile.unsupported
        refused = refusals.refused_argument(call, encoder_keyed=True)
        if refused is not None:
            return refused
        return self._clip_problem(features, call) or self._settings_problem(call)

    def _clip_problem(self, features: Any, call: dict[str, Any]) -> str | None:
        """What keeps the audio (features and mask) from being one short-form clip to hash, if anything."""
        if not isinstance(features, torch.Tensor) or features.dim() != 3 or not features.is_floating_point():
            return reasons.NO_INPUT_FEATURES
        if features.shape[0] != 1:
            return reasons.BATCH_SIZE
        if features.shape[-1] > self._num_frames:
            return reasons.LONG_FORM
        if features.shape[-1] < self._num_frames:
            # Whisper reports segment times and progress from the unpadded frame count, a hit's encoder output has none.
            for name, reason in (
                ("return_segments", reasons.RETURN_SEGMENTS),
                ("monitor_progress", reasons.MONITOR_PROGRESS),
            ):
                if call.get(name):
                    return reason
        mask = call.get("attention_mask")
        if mask is not None and not isinstance(mask, torch.Tensor):
            return reasons.UNHASHABLE_MEDIA
        return None

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
        modes = refusals.Modes(expands=self._profile.expands)
        problem = refusals.decoding_problem(setting, modes) or refusals.cache_implementation_problem(
            setting, _SERVED_IMPLEMENTATIONS
        )
        if problem is not None:
            return problem
        ids = call.get("decoder_input_ids")
        return refusals.ids_problem(ids) if ids is not None else None

    # ----------------------------------------------------------------- inner call
    def _serve_segment(self, *args: Any, **kwargs: Any) -> Any:
        """`generate_with_fallback` with the decoder prefix restored from, and the result stored in, the store."""
        bound = self._segment_signature.bind(*args, **kwargs)
        inner = dict(bound.arguments["kwargs"])
        request = request_in(_Request, self._store, inner)
        if request is None:
            return self._segment.original(*args, **kwargs)  # not ours (another store's hook may sit below)
        if request.served:
            # Whisper loops into another segment when one did not reach the clip's end. That segment's
            # encoder input is a later window, not the stored encoder output: give up and rerun cold.
            raise _AnotherSegment
        request.served = True
        bound.arguments["kwargs"] = inner
        ids: torch.Tensor = bound.arguments["decoder_input_ids"]
        # Whisper samples (without beams) when its one temperature is above 0, whatever `do_sample` says.
        temperature = bound.arguments["temperatures"][0]
        sampled = temperature is not None and temperature > 0.0
        request.expand = 1 if sampled else bound.arguments["generation_config"].num_beams or 1
        request.beams = request.expand > 1
        if not self._restore(request, ids, inner):
            return self._segment.original(*bound.args, **bound.kwargs)  # counted cold
        lease, working = request.lease, request.working
        assert lease is not None and working is not None
        # Whisper sets this itself only without an attention_mask; it makes generate feed just the uncached ids.
        bound.arguments["generation_config"]._mask_length = ids.shape[-1]
        try:
            output = self._segment.original(*bound.args, **bound.kwargs)
        finally:
            self._store.release(lease)
        # Counted by the outer call, once it knows the request ends here.
        request.counted = Served(int(ids.shape[-1]), lease.cached_len)
        self._store_segment(request, working, ids, output)
        return output

    def _next_segment(self, *args: Any, **kwargs: Any) -> Any:
        """Whisper's loop over the clip's windows: past the served first segment, give up (rerun cold).

        With several sequences only some rows may need another segment, and Whisper would then cut
        the finished rows out of `input_features`, which a served call does not pass.
        """
        if self._request is not None and self._request.served:
            raise _AnotherSegment
        return self._reduce.original(*args, **kwargs)

    def _restore(self, request: _Request, ids: torch.Tensor, inner: dict[str, Any]) -> bool:
        """Step 3, restore: the decoder prefix into the cache `inner` passes; False (counted cold, no cache passed)
        for a padded decoder prompt or when memory ran out."""
        mask = inner.get("decoder_attention_mask")
        if mask is not None and (mask.shape != ids.shape or not bool((mask == 1).all())):
            _compat.pop_cache(inner)
            self._store.record(Fallback(reasons.PADDING, int(ids.shape[-1])))
            return False
        return restore_into(request, ids, inner, request.expand)

    def _store_segment(self, request: _Request, working: WorkingCache, ids: torch.Tensor, output: Any) -> None:
        """Step 5, store: each row's decoder sequence, when it is what the cache holds plus one token; after beam
        search, the decoder prompt once (as `decoder_only.py` stores beams)."""
        if request.beams:
            batch_rows.trim(working, int(ids.shape[-1]), [0])
            store_decoder_rows(request, ids[:1], working)
            return
        rows = [_full_sequence(row) for row in output[1]]
        kv_len = working.kv_length()
        if kv_len is not None and all(row is not None and row.shape[-1] == kv_len + 1 for row in rows):
            sequences = torch.stack([row.reshape(-1) for row in rows if row is not None])
            store_decoder_rows(request, sequences, working)
        else:
            logger.warning("whisper output does not match its cache (%s vs %s); not stored", rows, kv_len)


class _AnotherSegment(Exception):
    """Whisper reached `generate_with_fallback` a second time in one request."""


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The generators sampling draws from: the CPU's, and the model's CUDA device's if it has one."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)


def _full_sequence(segment_output: Any) -> torch.Tensor | None:
    """The decoder ids `GenerationMixin.generate` returned for the one row (prompt included)."""
    if isinstance(segment_output, torch.Tensor):
        return segment_output
    sequences = segment_output.get("sequences") if isinstance(segment_output, dict) else None
    return sequences if isinstance(sequences, torch.Tensor) else None


register(Family("whisper", WhisperHook, {"whisper": "WhisperForConditionalGeneration"}))
