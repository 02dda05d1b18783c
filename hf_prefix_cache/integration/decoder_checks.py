"""The decoder-only hook's own checks: which calls can reuse safely (else the reason), and the prompt's media.

`check_call` runs step 1 in one pass: the model, the shared refused arguments (`refusals.py`),
the ids, the media kwargs, model kwargs the key does not cover, the decoding settings, then the
mask and pad tokens read with the ids (`refusals.read_prompt`). `media_layout` keys a prompt's
media items, or says why they cannot be keyed.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from transformers import GenerationConfig

from hf_prefix_cache import reasons
from hf_prefix_cache.errors import UnhashableMediaError
from hf_prefix_cache.integration import refusals
from hf_prefix_cache.integration.media_expansion import expands_media
from hf_prefix_cache.model.profile import ModelProfile
from hf_prefix_cache.multimodal import MEDIA_KWARGS
from hf_prefix_cache.multimodal.media import MediaLayout
from hf_prefix_cache.token_ids import TokenIds

logger = logging.getLogger("hf_prefix_cache")

# Generation settings (they steer decoding, not the prompt's states).
_GENERATION_FIELDS = frozenset(GenerationConfig().to_dict())  # type: ignore[no-untyped-call]
# Other generate kwargs the key covers (ids, an all-ones mask) or that leave states alone.
_KEYED_OR_HARMLESS = frozenset(
    {"input_ids", "attention_mask", "logits_to_keep", "tokenizer", "assistant_tokenizer", "use_model_defaults"}
)
# Cache implementations served on the working cache (dropped from the call); a static one (`GenerationSettings.static`)
# where the model's layers have a plain static form (`model/static.py`), for one prompt row decoded one sequence at a
# time.
_SERVED_IMPLEMENTATIONS = frozenset({"dynamic"})

# The names each check of the call's names looks for: a call that gives none of them skips that check (a set test),
# which would find nothing.
_REFUSED_NAMES = frozenset(refusals.REFUSED_ARGUMENTS)
_MEDIA_NAMES = frozenset(MEDIA_KWARGS)
_PLAIN_KWARGS = _GENERATION_FIELDS | _KEYED_OR_HARMLESS  # `_model_kwarg` passes over these


class Checked(NamedTuple):
    """What step 1 found: the call's settings and prompt (each row after its left padding, that padding) and why
    it runs cold (None: it may reuse). A call refused before its prompt is read has no settings and no rows."""

    settings: refusals.GenerationSettings | None
    rows: list[TokenIds]
    pads: tuple[int, ...]
    reason: str | None


def check_call(
    profile: ModelProfile,
    model: Any,
    signature: inspect.Signature,
    input_ids: Any,
    arguments: dict[str, Any],
    kwargs: dict[str, Any],
) -> Checked:
    """Step 1 of a decoder-only call in one pass: its settings and prompt, and the first reason it cannot reuse
    safely (None: it may reuse).

    The checks, in the order their reasons are counted:

    1. the model (`profile.unsupported`);
    2. arguments no family serves (`refusals.refused_argument`);
    3. the ids: one 2-D integer tensor of rows this model serves together (`_ids_problem`);
    4. media kwargs (`_media_problem`);
    5. model kwargs the key does not cover (`_model_kwarg`);
    6. decoding, cache-implementation and output settings (`_settings_problem`);
    7. the mask and pad tokens, read to the host with the ids (`refusals.read_prompt`).

    Checks 2, 4 and 5 run only when the call gives a name they look for, and 6 only when the settings
    are not plain (`GenerationSettings.is_plain`): a plain call (ids, a mask, generation settings)
    reads its settings, its ids and its prompt, and nothing else.
    """
    if profile.unsupported is not None:
        return _refused(profile.unsupported)
    if not (_REFUSED_NAMES.isdisjoint(kwargs) and _REFUSED_NAMES.isdisjoint(arguments)):
        problem = refusals.refused_argument({**kwargs, **arguments}, modes=serving_modes(profile))
        if problem is not None:
            return _refused(problem)
    problem = _ids_problem(profile, input_ids)
    if problem is None and not _MEDIA_NAMES.isdisjoint(kwargs):
        problem = _media_problem(profile, model, input_ids, kwargs)
    if problem is None and not kwargs.keys() <= _PLAIN_KWARGS:
        passed = _model_kwarg(profile, signature, kwargs)
        if passed is not None:
            # It reaches the model's forward and may change states the key does not cover (GPT-2's token_type_ids).
            problem = reasons.with_detail(reasons.MODEL_KWARG, passed)
    if problem is not None:
        return _refused(problem)
    settings = refusals.GenerationSettings(model, arguments.get("generation_config"), kwargs)
    if not settings.is_plain:
        problem = _settings_problem(profile, model, kwargs, settings)
        if problem is not None:
            return _refused(problem)
    # The one read of the device before the prefill: ids, mask and pad tokens.
    prompt = refusals.read_prompt(input_ids, kwargs.get("attention_mask"), settings)
    return Checked(settings, prompt.rows, prompt.pads, prompt.reason)


def _refused(reason: str) -> Checked:
    return Checked(None, [], (), reason)


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
    profile: ModelProfile, model: Any, kwargs: dict[str, Any], settings: refusals.GenerationSettings
) -> str | None:
    """Decoding, cache-implementation and output settings a hit could not reproduce."""
    served = _SERVED_IMPLEMENTATIONS
    if settings.static is not None and profile.serves_static and settings.expand == 1 and not settings.assisted:
        served = served | {settings.static}  # one sequence per prompt row: the static path copies one row's prefix
    problem = refusals.decoding_problem(settings, serving_modes(profile)) or refusals.cache_implementation_problem(
        settings, served
    )
    if problem is not None:
        return problem
    if settings.expand > 1 and _has_media(profile, kwargs) and not expands_media(model):
        # generate copies such media item by item ([A, B] -> [A, A, B, B]), not whole per row (`media_expansion.py`).
        return reasons.MEDIA_BATCH
    if settings.return_dict_in_generate and (problem := refusals.output_problem(settings)) is not None:
        return problem
    return None


def _has_media(profile: ModelProfile, kwargs: dict[str, Any]) -> bool:
    return profile.media is not None and any(kwargs.get(name) is not None for name in profile.media.handled)


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
