"""Tensor events the weights probe relies on, recorded as they happen anywhere in the process.

Three counters and one record, kept up to date by hooks installed on import:

* `structure_epoch`: bumped when any module registers a parameter or a new submodule (torch's
  registration hooks), so a probe re-reads a model's module list only then;
* `aliased`, `alias_seq`, `alias_epoch`: the storages that an alias writing past `_version` was
  taken of (`Tensor.data`, `Tensor.numpy`, DLPack), each with the sequence number of its latest alias;
* `replaced_seq`: bumped when a tensor's storage or layout is replaced in place without a version
  bump (a `.data` assignment, `torch.utils.swap_tensors`).

`weights.WeightsProbe` reads them (as attributes of this module: they are rebound); nothing here
knows a model. Installed once, when `hf_prefix_cache.keys.weights` is first imported.

Example:
    >>> import torch
    >>> from hf_prefix_cache.keys import tensor_events
    >>> before = tensor_events.alias_seq
    >>> _ = torch.zeros(2).data
    >>> tensor_events.alias_seq > before
    True
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

# Bumped whenever any module anywhere registers a parameter or a submodule (`module.weight =
# nn.Parameter(...)`, adding an adapter), so a cached parameter list is re-read only then.
structure_epoch = 0


_seen_modules: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _parameter_registered(*args: Any) -> None:
    global structure_epoch
    structure_epoch += 1


def _module_registered(parent: Any, name: str, module: Any) -> None:
    # Models slice their layer lists on every forward (`layers[:n]` registers the same layers in a
    # new ModuleList); only a module never registered before, or one replacing another (PEFT's
    # `unload` puts the base layer back in place of its LoRA wrapper), changes the structure.
    global structure_epoch
    replaced = getattr(parent, "_modules", {}).get(name)
    if module is not None and module not in _seen_modules:
        _seen_modules.add(module)
        structure_epoch += 1
    elif replaced is not None and replaced is not module:
        structure_epoch += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_parameter_registered)
torch.nn.modules.module.register_module_module_registration_hook(_module_registered)


# Storages that an alias writing past `_version` was taken of: `.data` (a tensor with a version
# counter of its own), `.numpy()` and DLPack, each with the sequence number of its latest alias,
# keyed by the address of the storage's StorageImpl (which stays when the storage is reallocated
# in place, by `resize_` or `share_memory_`, where its data pointer moves). A probe samples only
# the parameters of storages aliased since its last check, and those whose aliases are still alive.
aliased: dict[int, int] = {}
alias_seq = 0
ALIAS_LIMIT = 1 << 16  # past this many storages the record restarts, and every probe samples all once
alias_epoch = 0  # bumped when the record restarts
_TensorBase: Any = torch._C.TensorBase
_base_data = _TensorBase.data
_base_numpy = _TensorBase.numpy
_base_dlpack = torch.Tensor.__dlpack__


def _record_alias(tensor: Any) -> None:
    global alias_seq, alias_epoch
    try:
        ptr = tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):  # no storage (some subclasses): suspect everything
        ptr = None
    if ptr is None or len(aliased) >= ALIAS_LIMIT:
        aliased.clear()
        alias_epoch += 1
    if ptr is not None:
        alias_seq += 1
        aliased[ptr] = alias_seq


def _data(self: Any) -> Any:
    _record_alias(self)
    return _base_data.__get__(self)


# Bumped whenever any tensor's storage or layout is replaced in place without a version bump: an
# assignment to `.data` (keeps the tensor's version counter) or `torch.utils.swap_tensors` (swaps
# it). A probe compares its parameters' storages and layouts only after such an event.
replaced_seq = 0


def _set_data(self: Any, value: Any) -> None:
    global replaced_seq
    _base_data.__set__(self, value)
    replaced_seq += 1  # after the change: a check that reads the new count sees the new storage


def _numpy(self: Any, *args: Any, **kwargs: Any) -> Any:
    _record_alias(self)
    return _base_numpy(self, *args, **kwargs)


def _dlpack(self: Any, *args: Any, **kwargs: Any) -> Any:
    _record_alias(self)
    return _base_dlpack(self, *args, **kwargs)


_base_swap = torch._C._swap_tensor_impl


def _swap_tensor_impl(t1: torch.Tensor, t2: torch.Tensor) -> Any:
    global replaced_seq
    result = _base_swap(t1, t2)
    replaced_seq += 1
    return result


_DATA = property(_data, _set_data, doc=_base_data.__doc__)
torch.Tensor.data = _DATA  # type: ignore[assignment]
torch.Tensor.numpy = _numpy  # type: ignore[method-assign]
torch.Tensor.__dlpack__ = _dlpack  # type: ignore[method-assign]
# `torch.utils.swap_tensors` (used by `Module._apply` and `load_state_dict` under
# `torch.__future__.set_swap_module_params_on_conversion`, parametrizations, PEFT's hotswap) reads
# this attribute when it is called.
torch._C._swap_tensor_impl = _swap_tensor_impl


_data_ptr = torch._C.TensorBase.data_ptr


def layout(param: torch.Tensor) -> tuple[Any, ...]:
    """What an in-place replacement of `param`'s storage or view changes: pointer, dtype, shape, strides."""
    try:
        strides: tuple[int, ...] | None = param.stride()
    except RuntimeError:  # layouts without strides (sparse)
        strides = None
    return (_data_ptr(param), param.dtype, tuple(param.shape), strides)


def watched(param: Any) -> bool:
    """Whether every `.data` assignment to `param` goes through the recording setter above."""
    return getattr(type(param), "data", None) is _DATA


def storage_refs(param: torch.Tensor) -> int:
    """How many tensors share `param`'s storage, the parameter itself included."""
    return int(torch._C._storage_Use_Count(param.untyped_storage()._cdata)) - 1  # less the storage object made here
