"""The model's weights as the store sees them: a sampled fingerprint, a per-request probe of changes, the namespace.

`weights_fingerprint` and `adapter_state` feed the namespace (`namespace.py`); `WeightsProbe`
tells when to compute them again; `Namespaces` serves the store the current namespace, one
module for the whole per-request check.
"""

from __future__ import annotations

import logging
import operator
import threading
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from itertools import chain
from typing import Any

import torch

from hf_prefix_cache.keys import tensor_events as events
from hf_prefix_cache.keys.fingerprint import (
    adapter_state,
    dtype_from_parameters,
    is_tuner_layer,
    sample_indices,
    weights_fingerprint,
)
from hf_prefix_cache.keys.namespace import fingerprint, model_namespace

logger = logging.getLogger("hf_prefix_cache")

# Bumped whenever any module anywhere registers a parameter or a submodule (`module.weight =
# nn.Parameter(...)`, adding an adapter), so a cached parameter list is re-read only then.
_structure_epoch = 0


_seen_modules: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _parameter_registered(*args: Any) -> None:
    global _structure_epoch
    _structure_epoch += 1


def _module_registered(parent: Any, name: str, module: Any) -> None:
    # Models slice their layer lists on every forward (`layers[:n]` registers the same layers in a
    # new ModuleList); only a module never registered before, or one replacing another (PEFT's
    # `unload` puts the base layer back in place of its LoRA wrapper), changes the structure.
    global _structure_epoch
    replaced = getattr(parent, "_modules", {}).get(name)
    if module is not None and module not in _seen_modules:
        _seen_modules.add(module)
        _structure_epoch += 1
    elif replaced is not None and replaced is not module:
        _structure_epoch += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_parameter_registered)
torch.nn.modules.module.register_module_module_registration_hook(_module_registered)


# Storages that an alias writing past `_version` was taken of: `.data` (a tensor with a version
# counter of its own), `.numpy()` and DLPack, each with the sequence number of its latest alias,
# keyed by the address of the storage's StorageImpl (which stays when the storage is reallocated
# in place, by `resize_` or `share_memory_`, where its data pointer moves). A probe samples only
# the parameters of storages _aliased since its last check, and those whose aliases are still alive.
_aliased: dict[int, int] = {}
_alias_seq = 0
_ALIAS_LIMIT = 1 << 16  # past this many storages the record restarts, and every probe samples all once
_alias_epoch = 0  # bumped when the record restarts
_TensorBase: Any = torch._C.TensorBase
_base_data = _TensorBase.data
_base_numpy = _TensorBase.numpy
_base_dlpack = torch.Tensor.__dlpack__


def _record_alias(tensor: Any) -> None:
    global _alias_seq, _alias_epoch
    try:
        ptr = tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):  # no storage (some subclasses): suspect everything
        ptr = None
    if ptr is None or len(_aliased) >= _ALIAS_LIMIT:
        _aliased.clear()
        _alias_epoch += 1
    if ptr is not None:
        _alias_seq += 1
        _aliased[ptr] = _alias_seq


def _data(self: Any) -> Any:
    _record_alias(self)
    return _base_data.__get__(self)


def _numpy(self: Any, *args: Any, **kwargs: Any) -> Any:
    _record_alias(self)
    return _base_numpy(self, *args, **kwargs)


def _dlpack(self: Any, *args: Any, **kwargs: Any) -> Any:
    _record_alias(self)
    return _base_dlpack(self, *args, **kwargs)


_DATA = property(_data, events.set_data, doc=_base_data.__doc__)
torch.Tensor.data = _DATA  # type: ignore[assignment]
torch.Tensor.numpy = _numpy  # type: ignore[method-assign]
torch.Tensor.__dlpack__ = _dlpack  # type: ignore[method-assign]


def _watched(param: Any) -> bool:
    """Whether every `.data` assignment to `param` goes through the recording setter (`tensor_events.set_data`)."""
    return getattr(type(param), "data", None) is _DATA


# Elements the probe reads from a parameter it suspects: enough that an edit of a whole tensor
# (`p.data.add_(1)`, `p.data.mul_(1.5)`) shows, few enough to cost microseconds.
_PROBE_SAMPLES = 8

_version = operator.attrgetter("_version")
_parameters_of = operator.attrgetter("_parameters")
_values = operator.methodcaller("values")


class WeightsProbe:
    """A per-request check that a model's weights and adapters are still those it saw last, on the host.

    Each `check` notices, and counts as a change:

    * parameters added, removed or replaced, including by a direct `module._parameters[name] = p`
      (accelerate's `load_checkpoint_and_dispatch` after `init_empty_weights`);
    * a parameter's storage, dtype, shape or strides replaced under it (`p.data = other`, a view
      of the same storage included; `torch.utils.swap_tensors`; `model.to_empty()`, a dtype or
      device move): both routes are recorded when they run (`events.replaced_seq`), and only then does a
      check compare every parameter's pointer and layout with those it read last;
    * in-place writes that bump a parameter's `_version` (optimizer steps, `load_state_dict`,
      writes under `no_grad`, through `detach()` or views);
    * in-place writes through an alias that has a version counter of its own (`p.data.add_(1)`,
      PEFT's `merge_adapter`, `p.detach().numpy()`, DLPack): every such alias is recorded when it
      is made (`Tensor.data`, `Tensor.numpy` and `Tensor.__dlpack__` note its storage), and the
      parameters of those storages, and of every storage that another tensor still shares, get
      `_PROBE_SAMPLES` elements gathered and compared bitwise with those read last;
    * PEFT tuner layers switching their active, merged or disabled adapters.

    The first three and the last are host-side reads: a steady request reads each module's
    parameter dict and each parameter's version counter (and storage reference counts while an
    alias is alive), launches nothing on the device and waits for nothing. Not seen: a submodule
    put in place by a direct `module._modules[name] = child` write (no registration hook runs)
    until the next registration anywhere, a write through a raw storage (`untyped_storage()`, a
    pointer handed to C code) made and dropped between two requests, or an aliased write that
    leaves every sampled element as it was (one row of an embedding, say). Call
    `PrefixCache.invalidate()` after such an edit.

    Example:
        >>> probe = WeightsProbe(model)
        >>> before = probe.check()
        >>> _ = model.lm_head.weight.data.add_(1)
        >>> probe.check() > before
        True
    """

    def __init__(self, model: Any) -> None:
        self._model = model
        self._epoch = -1
        self._alias_epoch = -1
        self._seen = 0  # `_alias_seq` as of the last check
        self._replaced = -1  # `events.replaced_seq` as of the last check
        self._modules: list[torch.nn.Module] = []
        self._tuners: list[Any] = []
        self._built = False
        self._values: list[Any] = []  # every module's `_parameters` values at the last rebuild, None included
        self._params: list[Any] = []  # the same without None
        self._versions = 0  # the sum of their `_version` counters
        self._layouts: list[tuple[Any, ...]] = []  # their `events.layout`s
        self._unwatched: list[int] = []  # parameters whose `.data` assignments the setter above does not see
        self._adapters: tuple[Any, ...] | None = None
        self._by_storage: dict[int, list[int]] = {}
        self._exposed: set[int] = set()  # parameters whose storage another tensor shared at the last check
        self._reference: list[torch.Tensor | None] = []
        self.changes = 0
        self.num_sampled = 0  # parameters sampled by the last check (for tests and benchmarks)
        self.adapters: tuple[Any, ...] | None = None  # `adapter_state` as of the last check

    def check(self) -> int:
        """The number of changes seen so far (it grows by one whenever this check finds one)."""
        replaced = events.replaced_seq  # read first: an event during this check is looked at again by the next
        if self._epoch != _structure_epoch:
            self._epoch = _structure_epoch
            self._modules = list(self._model.modules())
            self._tuners = [m for m in self._modules if is_tuner_layer(m)]
        # Every module's parameter dict read again (a direct `_parameters[name] = p` has no hook), in
        # C-level loops, compared by identity; per parameter only its version counter is read, and
        # its storage and layout only after a `.data` assignment or a swap anywhere (`events.replaced_seq`).
        values = list(chain.from_iterable(map(_values, map(_parameters_of, self._modules))))
        adapters = adapter_state(self._model, self._tuners) if self._tuners else None
        self.adapters = adapters
        params = self._params
        changed = (
            not self._built
            or len(values) != len(self._values)
            or not all(map(operator.is_, values, self._values))
            or adapters != self._adapters
            or sum(map(_version, params)) != self._versions
        )
        if not changed and replaced != self._replaced:
            changed = list(map(events.layout, params)) != self._layouts
        elif not changed and self._unwatched:
            changed = any(events.layout(params[i]) != self._layouts[i] for i in self._unwatched)
        self._replaced = replaced
        if changed:
            self._rebuild(values, adapters)
            self.changes += 1
            return self.changes
        if self._alias_epoch != _alias_epoch:
            self._alias_epoch = _alias_epoch
            suspects = {i for members in self._by_storage.values() for i in members}
        elif _alias_seq != self._seen:
            aliased, seen = _aliased, self._seen
            suspects = {i for ptr, members in self._by_storage.items() if aliased.get(ptr, 0) > seen for i in members}
        else:
            suspects = set()
        self._seen = _alias_seq
        suspects |= self._exposed
        self.num_sampled = len(suspects)
        if suspects:
            self._exposed = {i for i in self._exposed | suspects if events.storage_refs(params[i]) > 1}
            if self._changed(sorted(suspects)):
                self.changes += 1
        return self.changes

    def _rebuild(self, values: list[Any], adapters: tuple[Any, ...] | None) -> None:
        """Record the parameters as they are now, index them by storage and read every one's sample."""
        params = [p for p in values if p is not None]
        self._built = True
        self._values, self._params, self._adapters = values, params, adapters
        self._versions = sum(map(_version, params))
        self._layouts = list(map(events.layout, params))
        self._unwatched = [i for i, p in enumerate(params) if not _watched(p)]
        self._alias_epoch, self._seen = _alias_epoch, _alias_seq
        self._by_storage = {}
        for i, p in enumerate(params):
            if p.device.type != "meta" and p.numel():
                self._by_storage.setdefault(p.untyped_storage()._cdata, []).append(i)
        live = [i for members in self._by_storage.values() for i in members]
        self._exposed = {i for i in live if events.storage_refs(params[i]) > 1}
        self._reference = [None] * len(params)
        with torch.no_grad():
            for i in live:
                self._reference[i] = _sample(params[i])
        self.num_sampled = len(live)

    def _changed(self, members: list[int]) -> bool:
        """Whether any of `members` differs from its reference (updated); one comparison per device and dtype."""
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i in members:
            if self._reference[i] is not None:
                p = self._params[i]
                groups.setdefault((p.device, p.dtype), []).append(i)
        changed = False
        with torch.no_grad():
            for group in groups.values():
                now = [_sample(self._params[i]) for i in group]
                before = [r for i in group if (r := self._reference[i]) is not None]
                same = (
                    torch.equal(torch.cat(now), torch.cat(before)) if len(group) > 1 else torch.equal(now[0], before[0])
                )
                if not same:
                    changed = True
                    for i, sample in zip(group, now, strict=True):
                        self._reference[i] = sample
        return changed


def _sample(param: torch.Tensor) -> torch.Tensor:
    """`_PROBE_SAMPLES` evenly spaced elements of `param`, as raw bytes so NaN and -0.0 compare bitwise."""
    flat = param.detach().reshape(-1)
    return torch.take(flat, sample_indices(flat.numel(), _PROBE_SAMPLES, flat.device)).view(torch.uint8)


class Namespaces:
    """The current namespace of one model, recomputed when its dtype, adapters or weights change.

    Entries are stored under a namespace (`namespace.model_namespace`): the model class and
    config, a fingerprint of its weights, its dtype, active adapters and the store's salt. A
    `WeightsProbe` runs on every request and, when it sees the weights change, the fingerprint is
    computed again, so entries of the old weights are never reused.

    Args:
        model: The model the store serves.
        salt: The store's salt (None: none).
        scopes: The request scopes active in this thread or task (`store.scope.ACTIVE_SCOPES`, passed in
            so this package imports nothing of the store's), read on every request.
        request_salt: The salt those scopes give this store (`store.scope.salt_of`; None: none), asked
            only inside a scope: when set, the namespace is that salt's own.

    Example:
        >>> from contextvars import ContextVar
        >>> namespaces = Namespaces(model, None, ContextVar("scopes", default=()), lambda active: None)
        >>> namespaces.current() == namespaces.current()
        True
    """

    def __init__(
        self,
        model: Any,
        salt: str | None,
        scopes: ContextVar[tuple[Any, ...]],
        request_salt: Callable[[tuple[Any, ...]], str | None],
    ) -> None:
        self._model = model
        self._salt = salt
        self._scopes = scopes
        self._request_salt = request_salt
        self._lock = threading.Lock()
        self._probe = WeightsProbe(model)
        self._weights = (self._probe.check(), weights_fingerprint(model))
        self._cached: tuple[Any, str] | None = None
        # Where the dtype is the parameters' own, it is read again only when the probe sees a change.
        self._dtype_per_request = not dtype_from_parameters(model)

    def current(self) -> str:
        """The model's current namespace (recomputed when its dtype, adapters or weights change).

        A `WeightsProbe` check runs on every call (a few microseconds per parameter); see
        `WeightsProbe` for what it notices and `refingerprint` for what it cannot.
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
        scopes = self._scopes.get()
        request_salt = self._request_salt(scopes) if scopes else None
        if request_salt is not None:
            return fingerprint([cached[1], "request salt", request_salt])
        return cached[1]

    def refingerprint(self) -> None:
        """Read the weights again now (after an edit the probe cannot see)."""
        with self._lock:
            self._weights = (self._probe.check(), weights_fingerprint(self._model))
            self._cached = None
