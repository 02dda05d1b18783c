"""Prompts with media in the decoder-only hook: their layout and namespace, the suffix's media, the reuse they lose.

`prompt_layout` and `prompt_namespace` key a prompt's media; `suffix_embeds` feeds a recurrent
prefill an uncached suffix with media; `expand_suffix_media` copies a hit's suffix media per row
for beams (on the models `expands_media` names); `media_padding_loss` and `count_new_media` find
reuse lost to a clip's padding or to media extending a stored chat.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from transformers import GenerationMixin

from hf_prefix_cache import _compat, reasons
from hf_prefix_cache.errors import UnhashableMediaError
from hf_prefix_cache.hooks.patching import InstancePatch
from hf_prefix_cache.keys.namespace import sub_namespace
from hf_prefix_cache.keys.prefix_key import PrefixKey
from hf_prefix_cache.model.profile import ModelProfile
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.multimodal.media import MediaLayout, item_symbols, symbol_content
from hf_prefix_cache.store.contract import Lease, ReducedReuse, Store
from hf_prefix_cache.token_ids import TokenIds

logger = logging.getLogger("hf_prefix_cache")

# The modalities `generate` encodes before copying rows (`_prepare_multimodal_encoder_kwargs_for_generation`).
_PRE_ENCODED = frozenset({"text", "image", "video"})
_OUTPUTS = "mm_encoder_outputs"
# transformers' generic copy of rows and of encoded media; GLM-4V's own copy interleaves items ([A, A, B, B]).
_GENERIC = ("_expand_inputs_for_generation", "_expand_multimodal_outputs")


def prompt_layout(
    profile: ModelProfile, rows: list[TokenIds], kwargs: dict[str, Any]
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


def prompt_namespace(
    profile: ModelProfile, namespace: str, tokens: TokenIds, layout: MediaLayout | None, kwargs: dict[str, Any]
) -> tuple[str, tuple[Any, ...]]:
    """The namespace of the prompt's states, and the media every position sees (its scope), for a model with media."""
    media = profile.media
    if media is None:
        return namespace, ()
    if media.whole_prompt_only:
        # Prefix-LM: every prompt position sees the whole prompt; only the same prompt may share states.
        symbols = layout.symbols(tokens) if layout is not None else tokens
        namespace = sub_namespace(namespace, [str(s) for s in symbols], media.prompt_parts(kwargs))
    scope = tuple(media.scope(layout.items)) if layout is not None else ()
    if scope:
        # Every position sees every medium of the prompt: share only between prompts with the same media.
        namespace = sub_namespace(namespace, list(scope))
    return namespace, scope


def suffix_embeds(
    profile: ModelProfile, input_ids: torch.Tensor, kwargs: dict[str, Any], layout: MediaLayout | None, cached_len: int
) -> torch.Tensor | None:
    """For a state prefill: the embeddings of `[cached_len, n)` when media lie there (else None: feed ids)."""
    media = profile.media
    if media is None or layout is None or cached_len >= input_ids.shape[1] - 1:
        return None
    if not any(item.end > cached_len for item in layout.items):
        return None  # the suffix is text: its ids embed the same way
    with torch.no_grad():
        return media.suffix_embeds(input_ids, kwargs, layout, cached_len)


def expands_media(model: Any) -> bool:
    """Whether `generate` encodes all of this model's media before copying rows, and copies each row's items whole
    as `GenerationMixin` does (others run such calls cold: `media_batch`)."""
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
    """Patch `model._expand_inputs_for_generation` so that, on a working cache holding a prefix, the encoded media
    are copied per row by the placeholders of the uncached ids only (a hit hands `generate` only their media)."""

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


def media_padding_loss(store: Store, key: PrefixKey, layout: MediaLayout, lease: Lease) -> int | None:
    """What reuse lost if it stopped at an item the store holds there with other padding (`media_padding`).

    Returns:
        The prompt tokens past the item's start stored with that item as stored (reusable had its
        padding been the stored one); None when reuse did not stop at such an item.
    """
    item = next((i for i in layout.items if i.start == lease.matched_len), None)
    if item is None:
        return None
    symbols = list(key.symbols)
    head, own = symbols[: item.start], symbols[item.start]
    for stored in store.next_symbols(key.namespace, head):
        if stored == own or not isinstance(stored, int) or symbol_content(stored) != (item.kind, item.content):
            continue  # this request's own item (stored since), another item, or text: nothing lost to padding
        probe = [*head, *item_symbols(stored, item.end - item.start), *symbols[item.end :]]
        lost = min(store.stored_len(key.namespace, probe), len(symbols) - 1) - item.start
        logger.debug(
            "prefix cache: reuse stopped at the %s at %d, stored with other padding: %d more tokens were stored",
            item.kind,
            item.start,
            lost,
        )
        return lost
    return None


def count_new_media(store: Store, profile: ModelProfile, base_namespace: str, layout: MediaLayout) -> None:
    """Count the adapter's event when this prompt's media extend those of a stored conversation."""
    media = profile.media
    if media is None or media.new_item_reason is None:
        return
    for j in range(len(layout.items) - 1, 0, -1):
        if store.has_entries(sub_namespace(base_namespace, media.scope(layout.items[:j]))):
            store.record(ReducedReuse(media.new_item_reason))
            return
