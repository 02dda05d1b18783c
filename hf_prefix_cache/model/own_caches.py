"""Models with a cache of their own (a `Cache` subclass, or a plain list of states): a working cache bridged to it.

MiniMax's forward refuses any cache that is not a `MiniMaxCache`, which keeps each
lightning-attention layer's state (the decayed sum of `key.T @ value`, `[B, H, D, D]`) in a list
beside its `DynamicCache` layers. transformers' own layer layout for MiniMax's config names
those layers `linear_attention` (a `LinearAttentionLayer`), so the working cache for MiniMax is
made a `MiniMaxCache` as well, whose `get_linear_cache` / `set_linear_cache` read and write that
layer's recurrent state: the state is then snapshotted and restored as every recurrent layer's
is (`layers/recurrent.py`). A state present makes MiniMax feed the following tokens one by one
through the same recurrence a cold run decodes with, which agrees with its blockwise prefill to
float rounding (tested against cold runs).

RWKV keeps no `Cache` at all: its forward takes `state`, a list of five `[B, hidden, layers]`
tensors that each block reads and writes at its own index (`state[k][:, :, i]`). Its working
cache is given one `LinearAttentionLayer` of five states per block, and answers `state[k]` with
a column whose `[:, :, i]` reads and writes layer `i`'s state `k`; `generate` is handed it as
`state`. The recurrence is computed per token (`rwkv_linear_attention_cpu`) or by the CUDA kernel
from the state it is given, so a continuation is what a prefill computes.

Bridges are found by model type; the model's module is imported only for a model of that type.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from transformers import DynamicCache

from hf_prefix_cache.errors import InconsistentStateError


class _LinearCacheBridge:
    """`MiniMaxCache`'s linear-state list, kept in the working cache's `LinearAttentionLayer`s instead."""

    layers: list[Any]

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
        layer = self.layers[layer_idx]
        # None until the layer's first forward: MiniMax then runs its blockwise prefill from a zero state.
        return layer.recurrent_states[0] if layer.is_recurrent_states_initialized[0] else None

    def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
        self.layers[layer_idx].update_recurrent_state(linear_cache, 0)

    def __len__(self) -> int:
        return len(self.layers)

    # MiniMaxCache's own versions walk its list; the layers know how to do it themselves.
    batch_repeat_interleave = DynamicCache.batch_repeat_interleave
    batch_select_indices = DynamicCache.batch_select_indices


_RWKV_STATES = 5  # per block: feed-forward shift, attention shift, numerator, denominator, running maximum
_RWKV_MAX_START = -1e30  # the running maximum's value before any token (RwkvModel's own start)


class _StateColumn:
    """`state[k]` of RWKV's list: `[:, :, i]` is layer `i`'s state `k` in the working cache."""

    def __init__(self, layers: list[Any], k: int) -> None:
        self._layers, self._k = layers, k

    def __getitem__(self, index: tuple[Any, ...]) -> torch.Tensor:
        layer = self._layers[_block_index(index)]
        held = layer.recurrent_states[self._k]
        if held is not None:
            return held  # type: ignore[no-any-return]
        # Before the block's first token: zeros (the maximum's start value), shaped as the shift the block has
        # just written; the attention shift is read first, and a zero scalar broadcasts where it is used.
        shift = layer.recurrent_states[1]
        if shift is None:
            return torch.zeros(())
        start = torch.zeros_like(shift, dtype=torch.float32 if self._k >= 2 else shift.dtype)
        return start.fill_(_RWKV_MAX_START) if self._k == _RWKV_STATES - 1 else start

    def __setitem__(self, index: tuple[Any, ...], value: torch.Tensor) -> None:
        layer = self._layers[_block_index(index)]
        layer.recurrent_states[self._k] = value  # RWKV makes each new state as a new tensor
        layer.is_recurrent_states_initialized[self._k] = layer.has_previous_state[self._k] = True
        layer.dtype, layer.device = value.dtype, value.device


def _block_index(index: tuple[Any, ...]) -> int:
    if not (isinstance(index, tuple) and len(index) == 3 and isinstance(index[2], int)):
        raise InconsistentStateError(f"state indexed by {index}")
    return index[2]


class _StateListBridge:
    """RWKV's `state` list, answered from the working cache's layers (one per block, five states each)."""

    layers: list[Any]

    def __getitem__(self, key: int | slice) -> Any:
        columns = [_StateColumn(self.layers, k) for k in range(_RWKV_STATES)]
        return columns[key]


def _rwkv_layers(config: Any) -> tuple[list[str], list[dict[str, Any]]]:
    """One linear-attention layer of five states per block (transformers' layout names no layer types for RWKV)."""
    count = config.num_hidden_layers
    return ["linear_attention"] * count, [{"number_of_states": _RWKV_STATES} for _ in range(count)]


class OwnCache(NamedTuple):
    """How a model type's own cache is met: the class its forward requires (None: it takes no `Cache` at all),
    the bridge onto the working cache's layers, the argument it takes the cache as (None: the usual one), and
    the working cache's layer types and their kwargs for its config (None: transformers' layout)."""

    base: type | None
    bridge: type
    cache_kwarg: str | None = None
    layer_specs: Callable[[Any], tuple[list[str], list[dict[str, Any]]]] | None = None


#: model type -> (module, class) of the cache the forward insists on (empty: none), and how it is met.
_BRIDGES: dict[str, tuple[str, str, OwnCache]] = {
    "minimax": ("transformers.models.minimax.modeling_minimax", "MiniMaxCache", OwnCache(None, _LinearCacheBridge)),
    "rwkv": ("", "", OwnCache(None, _StateListBridge, "state", _rwkv_layers)),
}


def own_cache_for(model_type: str | None) -> OwnCache | None:
    """How a model type's own cache is met (`OwnCache`), or None where it has none or no bridge knows it."""
    entry = _BRIDGES.get(model_type or "")
    if entry is None:
        return None
    module, name, own = entry
    if not module:
        return own
    base = getattr(importlib.import_module(module), name, None)
    return own._replace(base=base) if isinstance(base, type) else None


def bridged(cls: type, own: OwnCache) -> type:
    """`cls` (a working cache class) with the bridge of `own`, and made an instance of its own class if it has one."""
    key = (cls, own.bridge, own.base)
    made = _MADE.get(key)
    if made is None:
        bases = (cls, own.bridge) if own.base is None else (cls, own.bridge, own.base)
        name = f"{own.base.__name__ if own.base is not None else own.bridge.__name__.strip('_')}{cls.__name__}"
        made = type(name, bases, {"__module__": __name__})
        _MADE[key] = made
    return made


_MADE: dict[tuple[type, type, type | None], type] = {}
