"""Namespaces: the store's view of which model state its entries belong to.

Entries are stored under a namespace (`keys.namespace.model_namespace`): the model class and
config, a fingerprint of its weights, its dtype, active adapters and the user's salt. The
weights probe (`keys.weights.WeightsProbe`) runs on every request and, when it sees the weights
change, the fingerprint is computed again, so entries of the old weights are never reused.
Inside a request scope with a salt (`scope.py`), the namespace is that salt's own.
"""

from __future__ import annotations

import inspect
import logging
import threading
from typing import Any

from hf_prefix_cache.keys.namespace import fingerprint, model_namespace
from hf_prefix_cache.keys.weights import WeightsProbe, weights_fingerprint
from hf_prefix_cache.store.scope import CURRENT_SCOPE

logger = logging.getLogger("hf_prefix_cache")


# transformers' `dtype` properties (`PreTrainedModel.dtype` in 5.24, `ModuleUtilsMixin.dtype` in 5.23):
# the dtype of the first floating-point parameter, so it can change only with a parameter, which
# the probe sees.
_DTYPE_FROM_PARAMETERS = {
    ("transformers.modeling_utils", "PreTrainedModel.dtype"),
    ("transformers.modeling_utils", "ModuleUtilsMixin.dtype"),
}


def _dtype_from_parameters(model: Any) -> bool:
    """Whether `model.dtype` is transformers' property over the parameters (not an attribute of its own)."""
    found = inspect.getattr_static(type(model), "dtype", None)
    getter = getattr(found, "fget", None)
    return (
        isinstance(found, property)
        and (
            getattr(getter, "__module__", None),
            getattr(getter, "__qualname__", None),
        )
        in _DTYPE_FROM_PARAMETERS
    )


class Namespaces:
    """The current namespace of one model, recomputed when its dtype, adapters or weights change."""

    def __init__(self, model: Any, salt: str | None) -> None:
        self._model = model
        self._salt = salt
        self._lock = threading.Lock()
        self._probe = WeightsProbe(model)
        self._weights = (self._probe.check(), weights_fingerprint(model))
        self._cached: tuple[Any, str] | None = None
        # Where the dtype is the parameters' own, it is read again only when the probe sees a change.
        self._dtype_per_request = not _dtype_from_parameters(model)

    def current(self) -> str:
        """The model's current namespace (recomputed when its dtype, adapters or weights change).

        A `WeightsProbe` check runs on every call (a few microseconds per parameter); see
        `keys.weights.WeightsProbe` for what it notices and `refingerprint` for what it cannot.
        Inside a request scope with a salt (`store/scope.py`), a namespace of that salt's own.
        """
        model = self._model
        with self._lock:
            version = self._probe.check()
            cached = self._cached
            if cached is None or version != self._weights[0] or self._dtype_per_request:
                if version != self._weights[0]:
                    self._weights = (version, weights_fingerprint(model))
                probe = (getattr(model, "dtype", None), self._probe.adapters, self._weights[1])
                if cached is None or cached[0] != probe:
                    namespace = model_namespace(model, self._salt, self._weights[1], self._probe.adapters)
                    if cached is not None and cached[1] != namespace:
                        logger.info(
                            "the model's weights, dtype or adapters changed: entries stored before are no longer used"
                        )
                    cached = (probe, namespace)
                    self._cached = cached
        scope = CURRENT_SCOPE.get()
        if scope is not None and scope.salt is not None:
            return fingerprint([cached[1], "request salt", scope.salt])
        return cached[1]

    def refingerprint(self) -> None:
        """Read the weights again now (after an edit the probe cannot see)."""
        with self._lock:
            self._weights = (self._probe.check(), weights_fingerprint(self._model))
            self._cached = None
