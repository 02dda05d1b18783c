"""Beams and several sequences on a prompt with media: the suffix's encoded media copied to every row.

Before it copies a prompt row for beams or `num_return_sequences`, `generate` encodes the
call's images and videos (`mm_encoder_outputs`) and copies them group by group, finding where
each row's group ends by counting that row's placeholder ids (`_expand_multimodal_outputs`).
On a hit the store hands `generate` only the media of the uncached suffix, while the ids stay
whole: the cached items' placeholders would be counted too, no group would end where the
count says, and no features would reach the rows. `expand_suffix_media` counts in the ids the
working cache lacks instead, so each copy gets the suffix's items in prompt order, as a cold
call gives each copy all of them.

`expands_media` says which models `generate` treats that way: those that pre-encode every
media kind they take (images and videos) and keep transformers' generic copy. Others run such
calls cold (`media_batch`): audio features are copied item by item, and GLM-4V's own copy
interleaves the encoded items ([A, A, B, B]); for a prompt of several items either gives the
copies each other's items, and a hit, handed only the suffix's items, could not give them the
same wrong ones.
"""

from __future__ import annotations

from typing import Any

from transformers import GenerationMixin

from hf_prefix_cache import _compat
from hf_prefix_cache.hooks.patching import InstancePatch
from hf_prefix_cache.model.working_cache import WorkingCache

# The modalities `generate` encodes before copying rows (`_prepare_multimodal_encoder_kwargs_for_generation`).
_PRE_ENCODED = frozenset({"text", "image", "video"})
_OUTPUTS = "mm_encoder_outputs"
# transformers' generic copy of rows and of encoded media; GLM-4V's own copy interleaves items ([A, A, B, B]).
_GENERIC = ("_expand_inputs_for_generation", "_expand_multimodal_outputs")


def expands_media(model: Any) -> bool:
    """Whether `generate` encodes all of this model's media before copying rows and copies them as transformers'
    own `GenerationMixin` does (each row's items whole): a family's own copy may do otherwise."""
    supports = getattr(model, "_supports_mm_encoder_outputs", None)
    modalities = set(getattr(model, "input_modalities", ()) or ())
    cls = type(model)
    return (
        callable(supports)
        and bool(supports())
        and modalities <= _PRE_ENCODED
        and all(getattr(cls, name, None) is getattr(GenerationMixin, name, False) for name in _GENERIC)
    )


def expand_suffix_media(model: Any) -> InstancePatch:
    """Patch `model._expand_inputs_for_generation` so that, on a working cache holding a prefix, the encoded
    media are grouped by the placeholders of the uncached ids only."""

    def _expand_inputs_for_generation(
        expand_size: int = 1, is_encoder_decoder: bool = False, input_ids: Any = None, **model_kwargs: Any
    ) -> Any:
        cache = _compat.cache_in(model_kwargs)
        encoded = model_kwargs.get(_OUTPUTS)
        fed = cache.get_seq_length() if isinstance(cache, WorkingCache) else 0
        if expand_size > 1 and encoded and fed and input_ids is not None:
            suffix = input_ids[:, fed:]
            expanded = model._expand_multimodal_outputs(suffix, model_kwargs.pop(_OUTPUTS), expand_size=expand_size)
            input_ids, model_kwargs = patch.original(expand_size, is_encoder_decoder, input_ids, **model_kwargs)
            model_kwargs[_OUTPUTS] = expanded
            return input_ids, model_kwargs
        return patch.original(expand_size, is_encoder_decoder, input_ids, **model_kwargs)

    patch = InstancePatch(model, "_expand_inputs_for_generation", _expand_inputs_for_generation)
    return patch
