"""Models whose forward takes only their own `Cache` subclass: a working cache that is one of those too.

MiniMax's forward refuses any cache that is not a `MiniMaxCache`, which keeps each
lightning-attention layer's state (the decayed sum of `key.T @ value`, `[B, H, D, D]`) in a list
beside its `DynamicCache` layers. transformers' own layer layout for MiniMax's config names
those layers `linear_attention` (a `LinearAttentionLayer`), so the working cache for MiniMax is
made a `MiniMaxCache` as well, whose `get_linear_cache` / `set_linear_cache` read and write that
layer's recurrent state: the state is then snapshotted and restored as every recurrent layer's
is (`layers/recurrent.py`). A state present makes MiniMax feed the following tokens one by one
through the same recurrence a cold run decodes with, which agrees with its blockwise prefill to
float rounding (tested against cold runs).

Bridges are found by model type; the model's module is imported only for a model of that type.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from transformers import DynamicCache


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


#: model type -> (module, class) of the cache the forward insists on, and the bridge that maps it onto layers.
_BRIDGES: dict[str, tuple[str, str, type]] = {
    "minimax": ("transformers.models.minimax.modeling_minimax", "MiniMaxCache", _LinearCacheBridge),
}


def own_cache_base(model_type: str | None) -> tuple[type, type] | None:
    """The own cache class a model type's forward requires and the bridge onto working-cache layers, or None."""
    entry = _BRIDGES.get(model_type or "")
    if entry is None:
        return None
    module, name, bridge = entry
    base = getattr(importlib.import_module(module), name, None)
    return (base, bridge) if isinstance(base, type) else None


def bridged(cls: type, base: tuple[type, type]) -> type:
    """`cls` (a working cache class) made an instance of the own cache class too, through its bridge."""
    key = (cls, *base)
    made = _MADE.get(key)
    if made is None:
        own, bridge = base
        made = type(f"{own.__name__}{cls.__name__}", (cls, bridge, own), {"__module__": __name__})
        _MADE[key] = made
    return made


_MADE: dict[tuple[type, type, type], type] = {}
