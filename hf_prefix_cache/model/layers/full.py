"""Full attention (`DynamicLayer`): keys and values are shared, never copied.

transformers grows a `DynamicLayer` with `torch.cat`, which makes new tensors, so a stored
tensor is never written again and a prefix restores as a view `keys[..., :n, :]`.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.model.layers.base import LayerAdapter, LayerState


class FullAttentionAdapter(LayerAdapter):
    has_kv = True
    is_croppable = True
    has_static_form = True
    is_trimmable = True
    defers_keys = True  # this class alone: each subclass says False

    def prepare(self, layer: Any) -> None:
        pass

    def capture_kv(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
            return None
        return layer.keys, layer.values

    def restore_kv(self, layer: Any, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        # keys: [B, H, length, D], a view into the store
        if keys.shape[-2] != length:
            raise InconsistentStateError(f"restore of {length} tokens from keys of {keys.shape[-2]}")
        layer.dtype, layer.device = keys.dtype, keys.device
        layer.keys, layer.values = keys, values
        layer.is_initialized = True

    def trim(self, layer: Any, length: int, rows: torch.Tensor) -> None:
        """Keep positions `[0, length)` of batch `rows`, copied out (a store keeps no bytes it does not need)."""
        layer.keys, layer.values = layer.keys[rows, :, :length], layer.values[rows, :, :length]

    def snapshot_state(self, layer: Any) -> LayerState | None:
        return None

    def restore_state(self, layer: Any, state: LayerState) -> None:
        raise AssertionError("full attention layers have no recurrent state")
