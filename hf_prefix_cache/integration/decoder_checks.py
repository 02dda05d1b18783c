"""The decoder-only hook's own checks: which calls can reuse safely (else the reason), and the prompt's media.

`why_cold` runs the checks in order: the model, the shared refused arguments (`refusals.py`),
the ids, the media kwargs, model kwargs the key does not cover, and the decoding settings; the
mask and pad tokens are read later, with the ids (`refusals.read_prompt`). `media_layout` keys a
prompt's media items, or says why they cannot be keyed.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any

import torch
from transformers import GenerationConfig

from hf_prefix_cache import reasons
from hf_prefix_cache.errors import UnhashableMediaError
from hf_prefix_cache.integration import refusals
from hf_prefix_cache.integration.media_expansion import expands_media
from hf_prefix_cache.model.profile import ModelProfile
from hf_prefix_cache.multimodal import MEDIA_KWARGS
from hf_prefix_cache.multimodal.media import MediaLayout

logger = logging.getLogger("hf_prefix_cache")

# Generation settings (they steer decoding, not the prompt's states).
_GENERATION_FIELDS = frozenset(GenerationConfig().to_dict())  # type: ignore[no-untyped-call]
# Other generate kwargs the key covers (ids, an all-ones mask) or that leave states alone.
_KEYED_OR_HARMLESS = frozenset(
    {"input_ids", "attention_mask", "logits_to_keep", "tokenizer", "assistant_tokenizer", "use_model_defaults"}
)
# Cache implementations served on the working cache (dropped from the call); "static" where the model's layers have
# a plain static form (`model/static.py`), for one prompt row decoded one sequence at a time.
_SERVED_IMPLEMENTATIONS = frozenset({"dynamic"})
STATIC = "static"


def why_cold(
    profile: ModelProfile,
    model: Any,
    signature: inspect.Signature,
    input_ids: Any,
    arguments: dict[str, Any],
    kwargs: dict[str, Any],
) -> str | None:
    """Name the reason this call cannot reuse safely, or None."""
    if profile.unsupported is not None:
        return profile.unsupported
    modes = serving_modes(profile)
    problem = (
        refusals.refused_argument({**kwargs, **arguments}, modes=modes)
        or _ids_problem(profile, input_ids)
        or _media_problem(profile, model, input_ids, kwargs)
    )
    if problem is not None:
        return problem
    passed = _model_kwarg(profile, signature, kwargs)
    if passed is not None:
        # It reaches the model's forward and may change states the key does not cover (GPT-2's token_type_ids).
        return reasons.with_detail(reasons.MODEL_KWARG, passed)
    return _settings_problem(profile, model, arguments, kwargs, modes)


def serving_modes(profile: ModelProfile) -> refusals.Modes:
    """The decoding modes this model is served in: expanded rows where its layers keep every position or its
    rows' recurrent states can be joined (`recurrent_rows.py`), assisted decoding where transformers' `crop`
    keeps them exact (and `generate` slices the prompt)."""
    expands = profile.expands or profile.joins_rows
    return refusals.Modes(expands=expands, assisted=profile.is_croppable and profile.prompt_sliced)


def _ids_problem(profile: ModelProfile, input_ids: Any) -> str | None:
    """Ids that are not one 2-D integer tensor, or rows this model cannot serve in a batch."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        return reasons.NO_INPUT_IDS
    if input_ids.shape[0] != 1 and profile.has_state and not profile.joins_rows:
        # Window states and states beside media are restored for one row only.
        return reasons.BATCH_SIZE
    if input_ids.shape[1] == 0:
        return reasons.EMPTY_PROMPT
    if profile.exact_prompt_len is not None and input_ids.shape[1] > profile.exact_prompt_len:
        return reasons.with_detail(reasons.INDEXER_TOP_K, profile.exact_prompt_len)
    media = profile.media
    if input_ids.shape[0] != 1 and media is not None and (media.has_positions or media.whole_prompt_only):
        # Positions and prompt-wide namespaces are computed for one row.
        return reasons.MROPE_BATCH if media.has_positions else reasons.PREFIX_LM_BATCH
    return None


def _media_problem(profile: ModelProfile, model: Any, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> str | None:
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


def _model_kwarg(profile: ModelProfile, signature: inspect.Signature, kwargs: dict[str, Any]) -> str | None:
    """The first kwarg that `generate` would hand the model and the key does not cover, or None."""
    media = profile.media
    handled = media.handled | set(media.settings) if media is not None else frozenset()
    for name, value in kwargs.items():
        if value is None or name in _KEYED_OR_HARMLESS or name in handled or name in _GENERATION_FIELDS:
            continue
        if name in signature.parameters:
            continue
        return name
    return None


def _settings_problem(
    profile: ModelProfile, model: Any, arguments: dict[str, Any], kwargs: dict[str, Any], modes: refusals.Modes
) -> str | None:
    """Decoding, cache-implementation and output settings a hit could not reproduce."""
    config = refusals.GenerationSettings(model, arguments.get("generation_config"), kwargs)
    served = _SERVED_IMPLEMENTATIONS
    static = static_implementation(config)
    if static is not None and profile.serves_static and _one_sequence(config):
        served = served | {static}
    problem = refusals.decoding_problem(config, modes) or refusals.cache_implementation_problem(config, served)
    if problem is not None:
        return problem
    if refusals.expand_size(config) > 1 and _has_media(profile, kwargs) and not expands_media(model):
        # generate copies such media item by item ([A, B] -> [A, A, B, B]), not whole per row (`media_expansion.py`).
        return reasons.MEDIA_BATCH
    if config.return_dict_in_generate and (problem := refusals.output_problem(config)) is not None:
        return problem
    return None


def static_implementation(config: refusals.GenerationSettings) -> str | None:
    """The call's static cache implementation, or None: ``"static"``, or a deprecated name `generate` builds the
    same `StaticCache` for (``"sliding_window"``; ``"hybrid"`` when the call asks for it, since `generate` drops
    a model's default ``"hybrid"`` and decodes on a dynamic cache)."""
    impl = config.cache_implementation
    if impl in (STATIC, "sliding_window") or (
        impl == "hybrid" and config.explicit(refusals.CACHE_IMPLEMENTATION) == impl
    ):
        return str(impl)
    return None


def _has_media(profile: ModelProfile, kwargs: dict[str, Any]) -> bool:
    return profile.media is not None and any(kwargs.get(name) is not None for name in profile.media.handled)


def _one_sequence(config: refusals.GenerationSettings) -> bool:
    """One sequence decoded per prompt row, without assistance: the static path copies one row's prefix."""
    return refusals.expand_size(config) == 1 and not refusals.is_assisted(config)


def media_layout(
    profile: ModelProfile, rows: Sequence[Sequence[int]], kwargs: dict[str, Any]
) -> tuple[MediaLayout | None, str | None]:
    """The prompt's media items (None for a model without media handling), or why to run cold."""
    media = profile.media
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
    if profile.has_state and layout.items and layout.items[-1].end >= len(rows[0]):
        # The prefill stops before the last token and generate feeds it alone, with no media.
        return None, reasons.MEDIA_PROMPT_END
    return layout, None
