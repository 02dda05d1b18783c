"""InstancePatch: replaces one method of one model object, and puts it back.

The only way this package changes transformers' behaviour: an instance attribute shadows the
class's method (`model.generate`, `model.prepare_inputs_for_generation`, a family's inner
step), so other model objects, even of the same class, are untouched. Patches stack: a second
store on the same model wraps the first one's wrapper, and removing either one in any order
leaves the other working (a removed patch's wrapper passes calls straight through).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


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
