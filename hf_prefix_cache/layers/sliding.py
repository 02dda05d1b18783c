"""Sliding-window and chunked attention (`DynamicSlidingWindowLayer`), in two modes.

A plain sliding layer drops keys older than its window, after which it can no longer be
rewound. Chunked attention (Llama 4) uses the same layer class with the chunk size as its
window; only the mask differs, and the model builds that.

- Every position (`SlidingWindowAdapter`, the default): the working cache switches on
  transformers' past recording, so the layer keeps every position while attention still sees
  only the window. The store holds these layers exactly like full attention, and any stored
  length restores as a slice. Costs every position, like full attention.
- Window (`WindowStateAdapter`, `PrefixCache(sliding_window_mode="window")`): the layer is
  stored as a state, like a recurrent one: at each snapshot point its last `window - 1` keys
  and values and its length are cloned, and a restore loads them. Costs one window per
  snapshot, so a long prompt costs about what the model's own cache does; a prefix restores
  only at snapshot points (prompt ends, answer ends, divergences).
"""

from __future__ import annotations

from typing import Any

import torch

from .base import LayerState
from .full import FullAttentionAdapter


class SlidingWindowAdapter(FullAttentionAdapter):
    def prepare(self, layer: Any) -> None:
        # Keep all past keys: `update` then returns only the visible window, exactly as without recording.
        layer.activate_past_recording()

    def capture_kv(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        kv = super().capture_kv(layer)
        if kv is not None:
            assert kv[0].shape[-2] == layer.cumulative_length, (
                f"sliding layer holds {kv[0].shape[-2]} keys for {layer.cumulative_length} positions; "
                "past recording was off"
            )
        return kv

    def restore_kv(self, layer: Any, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        super().restore_kv(layer, keys, values, length)
        layer.record_past = True
        layer.cumulative_length = length
        layer._sliding_window_tensor = layer._sliding_window_tensor.to(keys.device)


class WindowStateAdapter:
    """A sliding layer kept as its window: snapshots of the last `window - 1` keys/values and the length."""

    has_kv = False
    has_state = True

    def prepare(self, layer: Any) -> None:
        pass  # no past recording: the layer keeps only its window, as without a store

    def capture_kv(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None

    def restore_kv(self, layer: Any, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        raise AssertionError("a windowed sliding layer restores from snapshots, not keys")

    def snapshot_state(self, layer: Any) -> LayerState | None:
        # The layer's keys are a view of the last forward's whole concatenation: clone the window only.
        keep = layer.sliding_window - 1
        keys = layer.keys[..., -keep:, :].clone() if layer.is_initialized else None
        values = layer.values[..., -keep:, :].clone() if layer.is_initialized else None
        return LayerState(
            tensors={"keys": {0: keys}, "values": {0: values}},
            flags={"cumulative_length": {0: int(layer.cumulative_length)}},
        )

    def restore_state(self, layer: Any, state: LayerState) -> None:
        keys, values = state.tensors["keys"][0], state.tensors["values"][0]
        layer.cumulative_length = int(state.flags["cumulative_length"][0])
        if keys is None or values is None:
            return
        # transformers concatenates onto these (new tensors), so the snapshot is never written.
        layer.keys, layer.values = keys, values
        layer.dtype, layer.device = keys.dtype, keys.device
        layer.is_initialized = True
        layer._sliding_window_tensor = layer._sliding_window_tensor.to(keys.device)
