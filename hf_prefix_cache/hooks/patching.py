"""How hooks attach: `InstancePatch` replaces one method of one model object, `PatchingHook` is every hook's base,
and the registry from model family to the hook that serves it.

An instance attribute shadows the class's method, so other model objects, even of the same class,
are untouched; patches stack, and removing either of two in any order leaves the other working.
Each hook module declares its family with `register`; `family_of` picks a model's and `attach`
makes its hook.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from hf_prefix_cache.store.contract import Serving, Store


class InstancePatch:
    """`model.<name>` calls `replacement` until `remove`; `original` is what was there before.

    Example:
        >>> import types
        >>> model = types.SimpleNamespace(generate=lambda x: x + 1)
        >>> patch = InstancePatch(model, "generate", lambda x: patch.original(x) * 10)
        >>> model.generate(1)
        20
        >>> patch.remove()
        >>> model.generate(1)
        2
    """

    def __init__(self, model: Any, name: str, replacement: Callable[..., Any]) -> None:
        self._model = model
        self._name = name
        self.original: Callable[..., Any] = getattr(model, name)
        # Another patch's wrapper, when this object has one already: put back on removal, not deleted.
        self._outer: Any = vars(model).get(name) if hasattr(model, "__dict__") else None
        self.active = True

        @functools.wraps(self.original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self.active:  # removed while a later patch's wrapper still calls this one
                return self.original(*args, **kwargs)
            return replacement(*args, **kwargs)

        wrapper._prefix_cache_patch = self  # type: ignore[attr-defined]
        self.wrapper = wrapper
        setattr(model, name, wrapper)

    def remove(self) -> None:
        """Stop calling the replacement; restore the attribute unless a later patch sits on top."""
        self.active = False
        if vars(self._model).get(self._name) is not self.wrapper:
            return
        outer = self._outer
        while outer is not None and not getattr(getattr(outer, "_prefix_cache_patch", None), "active", True):
            outer = outer._prefix_cache_patch._outer  # an earlier patch was removed meanwhile: skip its wrapper
        if outer is not None:
            setattr(self._model, self._name, outer)
        else:
            delattr(self._model, self._name)


class _Removable(Protocol):
    def remove(self) -> None: ...


R = TypeVar("R", bound=_Removable | None)


class PatchingHook:
    """Installs itself (its `__call__`, the request) as `model.generate`; `detach` removes it and every patch kept
    with `_keep`. `_original` is the `generate` it replaced, `_signature` the signature a call is bound with."""

    def __init__(self, store: Store, model: Any, serving: Serving) -> None:
        self._store = store
        self._model = model
        self._serving = serving
        self._profile = serving.profile
        self._patches: list[_Removable] = []
        self._original = self._patch("generate", self).original
        self._signature = generate_signature(model, self._original)
        params = self._signature.parameters.values()
        self._positional = tuple(p.name for p in params if p.kind in _POSITIONAL)
        self._var_keyword = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def _arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """A call's arguments by parameter name, its ``**kwargs`` among them: what `Signature.bind_partial` binds,
        flattened, at the cost of a dict (a call that cannot be bound so is bound by it, raising as `generate` would).
        """
        names = self._positional
        if len(args) <= len(names):
            arguments = dict(zip(names, args, strict=False))  # the first len(args) names
            if arguments.keys().isdisjoint(kwargs):
                arguments.update(kwargs)
                return arguments
        arguments = dict(self._signature.bind_partial(*args, **kwargs).arguments)
        if self._var_keyword is not None:
            arguments.update(arguments.pop(self._var_keyword, {}))
        return arguments

    def _patch(self, name: str, replacement: Callable[..., Any]) -> InstancePatch:
        """Replace `model.<name>` by `replacement` until `detach`."""
        return self._keep(InstancePatch(self._model, name, replacement))

    def _keep(self, patch: R) -> R:
        """Remove `patch` (None: nothing installed) on `detach` too; `patch` itself returned."""
        if patch is not None:
            self._patches.append(patch)
        return patch

    def detach(self) -> None:
        """Put the model's own methods back, in the order they were replaced."""
        patches, self._patches = self._patches, []
        for patch in patches:
            patch.remove()


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def generate_signature(model: Any, original: Callable[..., Any]) -> inspect.Signature:
    """The signature `generate` binds a call with (a PeftModel's: its base model's, which it hands calls to)."""
    base = getattr(model, "get_base_model", None)
    if callable(base) and base() is not model:
        return inspect.signature(base().generate)
    signature = inspect.signature(original)
    if any(p.kind not in _PASSED_ON for p in signature.parameters.values()):
        return signature
    # A `generate(*args, **kwargs)` handing its arguments on (Granite Speech's): the signature it hands them to.
    for cls in type(model).__mro__:
        method = cls.__dict__.get("generate")
        if method is None:
            continue
        parameters = list(inspect.signature(method).parameters.values())[1:]  # without `self`
        if any(p.kind not in _PASSED_ON for p in parameters):
            return inspect.Signature(parameters)
    return signature


_PASSED_ON = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


DECODER_ONLY = "decoder_only"


class Hook(Protocol):
    """What `attach` returns: an installed wrapper of `model.generate`."""

    def detach(self) -> None:
        """Put the model's own methods back."""
        ...


@dataclass(frozen=True, slots=True)
class Family:
    """A family of models served by one hook: `classes` maps a config `model_type` to the one model class proven
    exact for it (encoder-decoder families); empty for the decoder-only family, which takes every other model."""

    name: str
    make_hook: Callable[[Store, Any, Serving], Hook]
    classes: Mapping[str, str] = field(default_factory=dict)

    @property
    def encoder_keyed(self) -> bool:
        """Whether prefixes are keyed by the encoder input too (encoder-decoder families)."""
        return self.name != DECODER_ONLY


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> None:
    """Declare `family` (called once by each hook module when it is imported).

    Raises:
        ValueError: a family of that name is registered already.
    """
    if family.name in _FAMILIES:
        raise ValueError(
            f"model family {family.name!r} is registered already (by {_FAMILIES[family.name].make_hook!r}); "
            "register each family once, under a name of its own"
        )
    _FAMILIES[family.name] = family


def family_of(model: Any) -> Family:
    """The family serving `model`: an encoder-decoder family listing its exact class, else decoder-only (which
    profiles an encoder-decoder model no family lists as not served, `encoder_decoder`)."""
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
