"""The refusals: the rules that say why a `generate` call cannot reuse safely, each returning a reason or None.

The rules every family shares (refused arguments, decoding, cache implementation, outputs, a
mask) and the decoder-only hook's own (media kwargs, model kwargs the key does not cover,
settings), with the decoding modes a profile serves (`serving_modes`).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig

from hf_prefix_cache import reasons
from hf_prefix_cache.hooks.media import expands_media
from hf_prefix_cache.model.profile import ModelProfile
from hf_prefix_cache.multimodal import MEDIA_KWARGS

if TYPE_CHECKING:
    from hf_prefix_cache.hooks.checks import GenerationSettings

#: Arguments no family serves, with the reason counted (and `encoder_outputs`, by the encoder-keyed families only:
#: for decoder-only models it is a media or model kwarg like others).
REFUSED_ARGUMENTS: Mapping[str, str] = {
    "inputs_embeds": reasons.INPUTS_EMBEDS,
    "decoder_inputs_embeds": reasons.INPUTS_EMBEDS,
    "position_ids": reasons.EXPLICIT_POSITION_IDS,
    "decoder_position_ids": reasons.EXPLICIT_POSITION_IDS,
    "assistant_model": reasons.ASSISTED_DECODING,
    "custom_generate": reasons.CUSTOM_GENERATE,
    "negative_prompt_ids": reasons.NEGATIVE_PROMPT,
}

CACHE_IMPLEMENTATION = "cache_implementation"


class Settings:
    """The settings every family reads, as a config or kwarg holds them (None where none sets them; the rules here
    read them of `checks.GenerationSettings`); a family that reads another adds it here."""

    __slots__ = ()
    num_beams: Any
    num_return_sequences: Any
    use_cache: Any
    prompt_lookup_num_tokens: Any
    assistant_early_exit: Any
    cache_implementation: Any
    output_attentions: Any
    output_hidden_states: Any
    return_dict_in_generate: Any
    max_new_tokens: Any
    max_length: Any
    max_cache_len: Any
    pad_token_id: Any
    eos_token_id: Any
    # Whisper's own (`whisper.py`).
    return_timestamps: Any
    return_token_timestamps: Any
    no_speech_threshold: Any


#: The settings every family reads: `GenerationSettings` reads each once, when the call's settings are made.
SETTINGS = tuple(Settings.__annotations__)

# Generation settings (they steer decoding, not the prompt's states).
GENERATION_FIELDS = frozenset(GenerationConfig().to_dict())  # type: ignore[no-untyped-call]
# Other generate kwargs the key covers (ids, an all-ones mask) or that leave states alone.
KEYED_OR_HARMLESS = frozenset(
    {"input_ids", "attention_mask", "logits_to_keep", "tokenizer", "assistant_tokenizer", "use_model_defaults"}
)
# Cache implementations served on the working cache (dropped from the call); a static one (`GenerationSettings.static`)
# where the model's layers have a plain static form (`model/static.py`), outside assisted decoding.
_SERVED_IMPLEMENTATIONS = frozenset({"dynamic"})


@dataclass(frozen=True, slots=True)
class Modes:
    """The decoding modes a hook serves on a restored cache beyond one sequence per row: `expands` (beams, several
    returned sequences: the prefix restored into every copy), `assisted` (assisted and prompt-lookup decoding)."""

    expands: bool = False
    assisted: bool = False


def serving_modes(profile: ModelProfile) -> Modes:
    """The decoding modes this model is served in: expanded rows where its layers keep every position or its rows'
    recurrent states can be joined, assisted decoding where transformers' `crop` keeps them exact and `generate`
    slices the prompt (recurrent states: from transformers 5.25, only the cache's own, which a multi-token
    forward continues and whose chunked and one-token forms agree, `ModelProfile.assists_exactly`)."""
    expands = profile.expands or profile.joins_rows
    own_states = profile.own_cache is None and not profile.single_token_steps and profile.assists_exactly
    assisted = profile.is_croppable and profile.prompt_sliced and (own_states or not profile.has_recurrence)
    return Modes(expands=expands, assisted=assisted)


def refused_argument(given: Mapping[str, Any], encoder_keyed: bool = False, modes: Modes = Modes()) -> str | None:
    """The reason for the first refused argument given (not None) in `given` (an assistant model where
    `modes.assisted` serves it), or None."""
    for name, reason in REFUSED_ARGUMENTS.items():
        if name == "assistant_model" and modes.assisted:
            continue
        if given.get(name) is not None:
            return reason
    return reasons.ENCODER_OUTPUTS if encoder_keyed and given.get("encoder_outputs") is not None else None


def decoding_problem(config: GenerationSettings, modes: Modes = Modes()) -> str | None:
    """Why these decoding settings cannot run on a restored cache (beams, several sequences, no cache,
    assisted decoding) with the hook's `modes`, or None."""
    if (config.num_beams or 1) > 1 and not modes.expands:
        return reasons.BEAM_SEARCH
    if (config.num_return_sequences or 1) > 1 and not modes.expands:
        return reasons.NUM_RETURN_SEQUENCES
    if config.use_cache is False:
        return reasons.USE_CACHE_FALSE
    if config.assisted and not modes.assisted:
        return reasons.ASSISTED_DECODING
    return None


def cache_implementation_problem(config: GenerationSettings, served: frozenset[str]) -> str | None:
    """Why the call's cache implementation rules the store out (transformers refuses a passed cache beside any), or
    None: those `served` the hook drops, a model-default ``"hybrid"`` (Gemma) yields to a passed cache."""
    impl = config.cache_implementation
    if impl is None or impl in served or (impl == "hybrid" and config.explicit(CACHE_IMPLEMENTATION) is None):
        return None
    return reasons.with_detail(reasons.CACHE_IMPLEMENTATION, impl)


def output_problem(config: GenerationSettings) -> str | None:
    """Attentions or hidden states asked for: a hit skips the positions (or the encoder) they would cover."""
    if config.output_attentions:
        return reasons.OUTPUT_ATTENTIONS
    if config.output_hidden_states:
        return reasons.OUTPUT_HIDDEN_STATES
    return None


def mask_problem(mask: Any, ids: torch.Tensor) -> str | None:
    """Why an attention mask for `ids` would change what the key covers (a shape mismatch, padding), or None."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
        return reasons.ATTENTION_MASK_SHAPE
    if not bool((mask == 1).all()):
        return reasons.PADDING
    return None


def media_problem(profile: ModelProfile, model: Any, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> str | None:
    """Media kwargs this model's adapter does not handle, or cannot serve in this call."""
    media = profile.media
    media_names = [name for name in MEDIA_KWARGS if kwargs.get(name) is not None]
    if media is None and media_names == ["token_type_ids"]:
        media_names = []  # a text model's segment ids (GPT-2): a model kwarg like any other, refused below
    if not media_names:
        return None
    if media is None:
        return reasons.with_detail(reasons.MEDIA_INPUTS, getattr(model.config, "model_type", None))
    unknown = [name for name in media_names if name not in media.handled]
    if unknown:
        return reasons.with_detail(reasons.MEDIA_INPUTS, unknown[0])
    if input_ids.shape[0] != 1:
        return reasons.MEDIA_BATCH
    if profile.has_state and not media.embeds_suffix:
        return reasons.MEDIA_RECURRENT
    return None


def model_kwarg(profile: ModelProfile, signature: inspect.Signature, kwargs: dict[str, Any]) -> str | None:
    """The first kwarg that `generate` would hand the model and the key does not cover, or None."""
    media = profile.media
    handled = media.handled | set(media.settings) if media is not None else frozenset()
    for name, value in kwargs.items():
        if value is None or name in KEYED_OR_HARMLESS or name in handled or name in GENERATION_FIELDS:
            continue
        if name in signature.parameters:
            continue
        return name
    return None


def settings_problem(
    profile: ModelProfile, model: Any, kwargs: dict[str, Any], settings: GenerationSettings
) -> str | None:
    """Decoding, cache-implementation and output settings a hit could not reproduce."""
    served = _SERVED_IMPLEMENTATIONS
    if settings.static is not None and profile.serves_static and not settings.assisted:
        served = served | {settings.static}  # the restored rows are copied into the static buffers (`model/static.py`)
    problem = decoding_problem(settings, serving_modes(profile)) or cache_implementation_problem(settings, served)
    if problem is not None:
        return problem
    # With media, generate may copy them item by item ([A, B] -> [A, A, B, B]), not whole per row (`media.py`).
    handled = profile.media.handled if profile.media is not None else ()
    if settings.expand > 1 and any(kwargs.get(name) is not None for name in handled) and not expands_media(model):
        return reasons.MEDIA_BATCH
    if settings.return_dict_in_generate and (problem := output_problem(settings)) is not None:
        return problem
    return None
