"""The one registry of media families: each family module registers its row here.

A row (`MediaFamily`) declares what the rest of the package, the support matrix and the test
suite need to know of a family: the adapter that serves it, the model types (or
``"<model type>/<vision model type>"`` tower keys) it serves, the media kwargs only its calls carry
(they join `MEDIA_KWARGS`, so the hook refuses them for every other model), or, for a family that
was examined and left cold, why. Family modules call `register` at import; `multimodal/__init__`
imports every module of the package, so a new family is its module and the row in it.

Knows nothing about the store, the hook or the tree.

Example:
    >>> from hf_prefix_cache.multimodal import registry
    >>> registry.family("qwen2_vl").adapter.__name__
    'Qwen2VLMedia'
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hf_prefix_cache.multimodal.base import MediaAdapter


@dataclass(frozen=True, slots=True)
class MediaFamily:
    """One media family's row.

    Attributes:
        model_types: The keys it serves: model types, or ``"<model type>/<vision model type>"`` for
            one tower of a family (such a key wins over the plain model type).
        adapter: Builds the adapter of a model (a `MediaAdapter` class, or a function returning
            None when the model's config breaks the family's assumptions); None for a cold family.
        kwargs: Media kwargs only this family's calls carry, beyond the shared ones
            (`base.SHARED_MEDIA_KWARGS`): they join `MEDIA_KWARGS` in registration order.
        cold: Why media of a family examined and left cold cannot be served (documentation as data:
            the store never reads it; the support matrix shows it in the media column).
    """

    model_types: tuple[str, ...]
    adapter: Callable[[Any], MediaAdapter | None] | None
    kwargs: tuple[str, ...] = ()
    cold: str | None = None

    def __post_init__(self) -> None:
        assert self.model_types, "a media family serves at least one model type"
        assert (self.adapter is None) == (self.cold is not None), (
            f"{self.model_types}: a family has an adapter, or a reason it stays cold, not both"
        )


#: Family key (model type or tower key) -> its row, in registration order.
FAMILIES: dict[str, MediaFamily] = {}


def register(row: MediaFamily) -> MediaFamily:
    """Add `row` under each of its model types.

    Raises:
        ValueError: when one of its keys is already registered (two rows cannot serve one type).
    """
    taken = [key for key in row.model_types if key in FAMILIES]
    if taken:
        raise ValueError(f"media family keys registered twice: {taken}; each model type has one row")
    for key in row.model_types:
        FAMILIES[key] = row
    return row


def family_key(config: Any) -> str | None:
    """The registry key of a model of `config` (its tower key first), or None."""
    model_type = getattr(config, "model_type", "")
    vision_type = getattr(getattr(config, "vision_config", None), "model_type", None)
    for key in (f"{model_type}/{vision_type}", model_type):
        if key in FAMILIES:
            return key
    return None


def family(key: str) -> MediaFamily:
    """The row registered under `key`.

    Raises:
        KeyError: naming `key` when no family module registered it.
    """
    try:
        return FAMILIES[key]
    except KeyError:
        raise KeyError(f"no media family registered for {key!r}; see hf_prefix_cache/multimodal/registry.py") from None


def served() -> list[str]:
    """The keys whose media an adapter serves, in registration order."""
    return [key for key, row in FAMILIES.items() if row.adapter is not None]


def cold() -> dict[str, str]:
    """The keys examined and left cold on media, each with why."""
    return {key: row.cold for key, row in FAMILIES.items() if row.cold is not None}


def media_kwargs(shared: tuple[str, ...]) -> tuple[str, ...]:
    """`shared`, then every row's own media kwargs not in it, in registration order."""
    own = (name for row in FAMILIES.values() for name in row.kwargs)
    return tuple(dict.fromkeys((*shared, *own)))
