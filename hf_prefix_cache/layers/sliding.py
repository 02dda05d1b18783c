"""Sliding-window and chunked attention (`DynamicSlidingWindowLayer`).

A plain sliding layer drops keys older than its window, after which it can no longer be
rewound. The working cache switches on transformers' past recording, so the layer keeps
every position while attention still sees only the window. The store then holds these
layers exactly like full attention, and any stored length restores as a slice: the window
state at every position is known. Chunked attention (Llama 4) uses the same layer class
with the chunk size as its window; only the mask differs, and the model builds that.
"""

from __future__ import annotations

from typing import Any

import torch

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
