"""DeepSeek-V4's compressed-attention layers (`DeepseekV4HCACache`, `DeepseekV4CSACache`): snapshots only.

Each layer keeps a sliding window of shared keys/values (the last `sliding_window - 1` tokens),
plus, per compressor (``"compressor"``, and ``"indexer"`` in CSA layers): the compressed entries
emitted so far (one per `compress_rate` tokens, at window-aligned absolute positions), the
projected tokens of the window still open (`buffer_kv` / `buffer_gate`), the count of entries,
and in CSA layers the previous window's overlap slice. All of it is a function of the tokens so
far, and a continuation from it computes what a full prefill does (windows close at the same
absolute positions whatever the chunking), so a snapshot taken at exactly a length restores that
length. It cannot go back (the window and the open buffer forget), like a recurrent state.

transformers grows every one of these by concatenation or slicing into new tensors, never in
place, so a restore hands the layer the snapshot's tensors themselves.

A CSA layer's indexer keeps the `index_topk` best compressed entries per query; while a query
sees no more than that, it keeps them all, so its selection cannot depend on the call's shape.
`entry_tokens` tells the profile how many tokens one entry covers (`ModelProfile.exact_prompt_len`).
"""

from __future__ import annotations

from typing import Any

import torch

from hf_prefix_cache.model.layers.base import LayerAdapter, LayerState

_PER_NAME_TENSORS = ("buffer_kv", "buffer_gate", "compressed_kv", "overlap_kv", "overlap_gate")


class CompressedAttentionAdapter(LayerAdapter):
    """One `DeepseekV4HCACache` or `DeepseekV4CSACache` layer, restored from a snapshot at its exact length."""

    has_state = True
    has_recurrence = True  # the compressed entries summarise every token so far
    is_croppable = False  # the window and the open buffer cannot go back

    def __init__(self, entry_tokens: int | None = None) -> None:
        #: Tokens one entry covers where an indexer ranks the layer's entries (CSA); None where none does (HCA).
        self.entry_tokens = entry_tokens

    def prepare(self, layer: Any) -> None:
        pass  # the layer keeps only its window, as without a store

    def capture_kv(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None

    def restore_kv(self, layer: Any, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        raise AssertionError("a compressed attention layer restores from snapshots, not keys")

    def snapshot_state(self, layer: Any) -> LayerState | None:
        # Clones: the window is a view of the last forward's whole concatenation, the buffer of its projection.
        tensors: dict[str, dict[int, torch.Tensor | None]] = {
            "keys": {0: layer.keys.clone() if layer.is_initialized else None}
        }
        flags: dict[str, dict[int, Any]] = {"cumulative_length": {0: int(layer.cumulative_length)}}
        for attr in _PER_NAME_TENSORS:
            for name, tensor in getattr(layer, attr, {}).items():
                tensors[f"{attr}.{name}"] = {0: tensor.clone() if tensor is not None else None}
        for name, count in layer.entry_count.items():
            flags[f"entry_count.{name}"] = {0: int(count)}
        return LayerState(tensors=tensors, flags=flags)

    def restore_state(self, layer: Any, state: LayerState) -> None:
        layer.cumulative_length = int(state.flags["cumulative_length"][0])
        for key, per_idx in state.tensors.items():
            if key == "keys":
                continue
            attr, name = key.split(".", 1)
            getattr(layer, attr)[name] = per_idx[0]
        for key, counts in state.flags.items():
            if key.startswith("entry_count."):
                layer.entry_count[key.split(".", 1)[1]] = int(counts[0])
        keys = state.tensors["keys"][0]
        if keys is None:
            return
        # Keys and values are one tensor (shared-KV attention), as the layer's own update keeps them.
        layer.keys = layer.values = keys
        layer.dtype, layer.device = keys.dtype, keys.device
        layer.is_initialized = True
        layer._sliding_window_tensor = layer._sliding_window_tensor.to(keys.device)
