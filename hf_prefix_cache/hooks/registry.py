"""The registry from model family to the hook that serves it, filled by the hook modules themselves.

Each hook module declares its family with `register`: a name, the hook class, and, for
encoder-decoder families, the exact model classes it was proven exact on (by `model_type`).
`family_of` picks the family of a model (decoder-only models get the default family);
`attach` makes the hook, which replaces `model.generate` until its `detach`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from hf_prefix_cache.store.contract import Serving, Store

DECODER_ONLY = "decoder_only"


class Hook(Protocol):
    """What `attach` returns: an installed wrapper of `model.generate`."""

    def detach(self) -> None:
        """Put the model's own methods back."""
        ...


@dataclass(frozen=True, slots=True)
class Family:
    """A family of models served by one hook.

    `classes` maps a config `model_type` to the one model class served for it (encoder-decoder
    families); empty for the decoder-only family, which takes every other model.
    """

    name: str
    make_hook: Callable[[Store, Any, Serving], Hook]
    classes: Mapping[str, str] = field(default_factory=dict)

    @property
    def encoder_keyed(self) -> bool:
        """Whether prefixes are keyed by the encoder input too (encoder-decoder families)."""
        return self.name != DECODER_ONLY


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> None:
    """Declare `family` (called once by each hook module when it is imported)."""
    assert family.name not in _FAMILIES, f"family {family.name!r} registered twice"
    _FAMILIES[family.name] = family


def family_of(model: Any) -> Family:
    """The family serving `model`: an encoder-decoder family listing its exact class, else decoder-only.

    An encoder-decoder model no family lists is profiled as not served (`encoder_decoder`).
    """
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        model_type = getattr(config, "model_type", None) or ""
        for family in _FAMILIES.values():
            if family.classes.get(model_type) == type(model).__name__:
                return family
    return _FAMILIES[DECODER_ONLY]


def attach(store: Store, model: Any, serving: Serving) -> Hook:
    """Wrap `model.generate` with the hook of `model`'s family, serving `store` as `serving` says."""
    return family_of(model).make_hook(store, model, serving)
