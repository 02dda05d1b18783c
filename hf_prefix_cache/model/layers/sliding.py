"""Sliding-window and chunked attention (`DynamicSlidingWindowLayer`), in two modes.

A plain sliding layer drops keys older than its window, after which it can no longer be
rewound. Chunked attention (Llama 4) uses the same layer class with the chunk size as its
window; only the mask differs, and the model builds that.

- Every position (`SlidingWindowAdapter`, the default): the working cache switches on
  transformers' past recording, so the layer keeps every position while attention still sees
  only the window. The store holds these layers exactly like full attention, and any stored
  length restores as a slice; assisted decoding's `crop` takes back only its rejected
  candidates. Costs every position, like full attention.
- Window (`WindowStateAdapter`, `PrefixCache(sliding_window_mode="window")`): the layer is
  stored as a state, like a recurrent one: at each snapshot point its last `window - 1` keys
  and values and its length are cloned, and a restore loads them. Costs one window per
  snapshot, so a long prompt costs about what the model's own cache does; a prefix restores
  only at snapshot points (prompt ends, answer ends, divergences).
"""

from __future__ import annotations

import types
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from hf_prefix_cache._compat import record_past
from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.model.layers.base import LayerAdapter, LayerState
from hf_prefix_cache.model.layers.full import FullAttentionAdapter


class SlidingWindowAdapter(FullAttentionAdapter):
    # transformers' crop cuts a recording layer back to its window ("minimal working size"), so later captures would
    # miss the positions before it: the working cache's layers crop only what is taken back (`_crop_keeping_past`).
    is_croppable = True
    # transformers' static form keeps the last `window` positions in one buffer (`model/static.py` fills it).
    has_static_form = True
    defers_keys = False  # landing at first use is for plain full attention alone
    needs_prepare = True  # past recording

    def prepare(self, layer: Any) -> None:
        # Keep all past keys: `update` then returns only the visible window, exactly as without recording.
        record_past(layer)
        layer.crop = types.MethodType(_crop_keeping_past, layer)

    def capture_kv(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        kv = super().capture_kv(layer)
        if kv is not None and kv[0].shape[-2] != layer.cumulative_length:
            raise InconsistentStateError(
                f"sliding layer holds {kv[0].shape[-2]} keys for {layer.cumulative_length} positions; "
                "past recording was off"
            )
        return kv

    def restore_kv(self, layer: Any, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        super().restore_kv(layer, keys, values, length)
        layer.record_past = True
        layer.cumulative_length = length
        layer._sliding_window_tensor = layer._sliding_window_tensor.to(keys.device)

    def trim(self, layer: Any, length: int, rows: torch.Tensor) -> None:
        super().trim(layer, length, rows)
        layer.cumulative_length = length


def _crop_keeping_past(layer: Any, tokens_to_remove: int) -> None:
    """A sliding layer's `crop` (assisted decoding takes its rejected candidates back) that removes the last
    `-tokens_to_remove` positions and keeps every earlier one, as full attention's does.

    Transformers' own also cuts a recording layer back to its last `window - 1` positions. What attention sees is the
    same either way: a recording layer's `update` returns only those and the new ones, and its mask is sized by
    `cumulative_length`, which both set to the positions left.
    """
    DynamicLayer.crop(layer, tokens_to_remove)
    if layer.is_initialized:
        layer.cumulative_length = layer.keys.shape[-2]


class WindowStateAdapter(LayerAdapter):
    """A sliding layer kept as its window: snapshots of the last `window - 1` keys/values and the length."""

    has_state = True
    restores_below_length = True  # `at`, `extend`
    is_croppable = False  # past the window, the keys to go back to are gone

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
        length = int(layer.cumulative_length)
        return LayerState(
            tensors={"keys": {0: keys}, "values": {0: values}},
            flags={"cumulative_length": {0: length}, "first_position": {0: max(length - keep, 0)}, "window": {0: keep}},
        )

    @staticmethod
    def extend(earlier: LayerState, later: LayerState) -> LayerState | None:
        """One state holding the positions of both windows (`later` continuing `earlier`), or None when
        they do not touch: it restores at any length from `earlier`'s to `later`'s (`at`)."""
        first_a, first_b = int(earlier.flags["first_position"][0]), int(later.flags["first_position"][0])
        end_a = int(earlier.flags["cumulative_length"][0])
        keys_a, values_a = earlier.tensors["keys"][0], earlier.tensors["values"][0]
        keys_b, values_b = later.tensors["keys"][0], later.tensors["values"][0]
        if keys_a is None or values_a is None or keys_b is None or values_b is None or first_b > end_a:
            return None
        # [B, H, first_b - first_a, D] from the earlier window, then the later window: positions [first_a, end_b).
        k = torch.cat([keys_a[..., : first_b - first_a, :], keys_b], dim=-2)
        v = torch.cat([values_a[..., : first_b - first_a, :], values_b], dim=-2)
        flags = {name: dict(per) for name, per in later.flags.items()}
        flags["first_position"] = {0: first_a}
        return LayerState(tensors={"keys": {0: k}, "values": {0: v}}, flags=flags)

    @staticmethod
    def at(state: LayerState, length: int) -> LayerState:
        """The window state after exactly `length` tokens, cut (as views) from an extended one."""
        first, end = int(state.flags["first_position"][0]), int(state.flags["cumulative_length"][0])
        keep = int(state.flags["window"][0])
        lo = max(length - keep, 0)
        if not (first <= lo and length <= end):
            raise InconsistentStateError(f"window state of [{first}, {end}) cannot restore {length}")
        keys, values = state.tensors["keys"][0], state.tensors["values"][0]
        assert keys is not None and values is not None
        return LayerState(
            tensors={
                "keys": {0: keys[..., lo - first : length - first, :]},
                "values": {0: values[..., lo - first : length - first, :]},
            },
            flags={"cumulative_length": {0: length}, "first_position": {0: lo}, "window": {0: keep}},
        )

    def restore_state(self, layer: Any, state: LayerState) -> None:
        end = int(state.flags["cumulative_length"][0])
        if int(state.flags["first_position"][0]) < max(end - int(state.flags["window"][0]), 0):
            state = self.at(state, end)  # an extended window: the layer holds only its own window
        keys, values = state.tensors["keys"][0], state.tensors["values"][0]
        layer.cumulative_length = end
        if keys is None or values is None:
            return
        # transformers concatenates onto these (new tensors), so the snapshot is never written.
        layer.keys, layer.values = keys, values
        layer.dtype, layer.device = keys.dtype, keys.device
        layer.is_initialized = True
        layer._sliding_window_tensor = layer._sliding_window_tensor.to(keys.device)
