"""Tensor events the weights probe relies on, recorded as they happen anywhere in the process.

One counter, kept up to date by hooks installed on import, and what a probe compares after it moves:

* `replaced_seq`: bumped when a tensor's storage or layout is replaced in place without a version
  bump (a `.data` assignment through `set_data`, `torch.utils.swap_tensors`).

* `layout` and `storage_refs`: what a replacement changes, and how many tensors share a storage.

The structure epoch (module registrations) and the record of aliases (`Tensor.data` reads,
`.numpy()`, DLPack) live in `weights.py`, beside the probe: those events happen on every request,
these only on an edit. `weights.WeightsProbe` reads `replaced_seq` as an attribute of this module
(it is rebound); nothing here knows a model.

Example:
    >>> import torch
    >>> from hf_prefix_cache.keys import tensor_events, weights  # weights puts `set_data` on `Tensor.data`
    >>> before = tensor_events.replaced_seq
    >>> t = torch.zeros(2)
    >>> t.data = torch.ones(2)
    >>> tensor_events.replaced_seq > before
    True
"""

from __future__ import annotations

from typing import Any

import torch

_base_data: Any = torch._C.TensorBase.data

# Bumped whenever any tensor's storage or layout is replaced in place without a version bump: an
# assignment to `.data` (keeps the tensor's version counter) or `torch.utils.swap_tensors` (swaps
# it). A probe compares its parameters' storages and layouts only after such an event.
replaced_seq = 0


def set_data(self: Any, value: Any) -> None:
    global replaced_seq
    _base_data.__set__(self, value)
    replaced_seq += 1  # after the change: a check that reads the new count sees the new storage


_base_swap = torch._C._swap_tensor_impl


def _swap_tensor_impl(t1: torch.Tensor, t2: torch.Tensor) -> Any:
    global replaced_seq
    result = _base_swap(t1, t2)
    replaced_seq += 1
    return result


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


def storage_refs(param: torch.Tensor) -> int:
    """How many tensors share `param`'s storage, the parameter itself included."""
    return int(torch._C._storage_Use_Count(param.untyped_storage()._cdata)) - 1  # less the storage object made here
