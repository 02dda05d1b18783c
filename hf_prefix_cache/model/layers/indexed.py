"""Sparse-attention layers with an indexer (`DynamicIndexedLayer`: DeepSeek-V3.2, GLM-5, ...).

Besides its keys and values, such a layer keeps the indexer's keys, one `[B, L, index_dim]`
row per token, which pick the tokens each query attends to. They are per-token state like
the keys, so they restore by slicing too. The store holds two tensors per layer, so the
indexer keys travel inside the values: each head's values get `ceil(index_dim / heads)` more
channels holding its share of the indexer row (zero-padded), and a restore splits them off
again. Capturing therefore copies the values once; the keys are still shared.

Kolibri 1.1's indexers keep no keys of their own: they rank the layer's keys themselves, so its
indexed layers hold plain keys and values (`KeyIndexedAttentionAdapter`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.model.layers.full import FullAttentionAdapter


class IndexedAttentionAdapter(FullAttentionAdapter):
    """`DynamicIndexedLayer` whose indexer keys are `index_dim` wide (the config's `index_head_dim`)."""

    has_static_form = False  # a static indexed layer keeps its indexer keys in buffers of its own
    defers_keys = False  # landing at first use is for plain full attention alone
    has_indexer_keys = True

    def __init__(self, index_dim: int, keeps_positions: bool = False) -> None:
        self.index_dim = index_dim
        #: Qwen4-Exp keeps its indexers' (text) positions, `[3, B, L]`, on its first indexed layer. A served call's
        #: positions are 0..L-1 (explicit positions are refused), so a restore rebuilds them.
        self.keeps_positions = keeps_positions

    def capture_kv(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        kv = super().capture_kv(layer)
        if kv is None:
            return None
        keys, values = kv
        indexer = layer.indexer_keys
        positions = layer.indexer_position_ids
        if self.keeps_positions:
            if positions is None or positions.shape[1:] != keys.shape[:1] + keys.shape[-2:-1]:
                raise InconsistentStateError(
                    f"indexer positions {None if positions is None else tuple(positions.shape)}, "
                    f"keys {tuple(keys.shape)}"
                )
        elif positions is not None:
            raise InconsistentStateError("indexer positions are not kept (only the indexer keys are)")
        if indexer is None or indexer.shape != (keys.shape[0], keys.shape[-2], self.index_dim):
            raise InconsistentStateError(
                f"indexer keys {None if indexer is None else tuple(indexer.shape)} for keys {tuple(keys.shape)}, "
                f"index_dim {self.index_dim}"
            )
        if indexer.dtype != values.dtype:
            raise InconsistentStateError(f"indexer keys in {indexer.dtype}, values in {values.dtype}")
        return keys, torch.cat([values, self._spread(indexer, values.shape[1])], dim=-1)

    def restore_kv(self, layer: Any, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        heads, per_head = values.shape[1], self._per_head(values.shape[1])
        packed = values[..., -per_head:]  # [B, H, L, per_head]
        indexer = packed.transpose(1, 2).reshape(values.shape[0], length, heads * per_head)[..., : self.index_dim]
        super().restore_kv(layer, keys, values[..., :-per_head], length)
        layer.indexer_keys = indexer.contiguous()
        layer.indexer_dtype, layer.indexer_device = indexer.dtype, indexer.device
        layer.is_indexer_initialized = True
        if self.keeps_positions:
            positions = torch.arange(length, device=indexer.device)
            layer.indexer_position_ids = positions.view(1, 1, -1).expand(3, values.shape[0], -1)

    def trim(self, layer: Any, length: int, rows: torch.Tensor) -> None:
        super().trim(layer, length, rows)
        layer.indexer_keys = layer.indexer_keys[rows, :length]
        if self.keeps_positions:
            layer.indexer_position_ids = layer.indexer_position_ids[:, rows, :length]

    def _per_head(self, heads: int) -> int:
        return -(-self.index_dim // heads)

    def _spread(self, indexer: torch.Tensor, heads: int) -> torch.Tensor:
        """`[B, L, index_dim]` as `[B, heads, L, per_head]`, zero-padded to `heads * per_head` channels."""
        per_head = self._per_head(heads)
        padded = F.pad(indexer, (0, heads * per_head - self.index_dim))
        return padded.view(indexer.shape[0], indexer.shape[1], heads, per_head).transpose(1, 2)


class KeyIndexedAttentionAdapter(FullAttentionAdapter):
    """`DynamicIndexedLayer` whose indexers rank the layer's own keys and keep none (Kolibri 1.1): full attention.

    Which keys a query attends to is the indexers' choice, made afresh by every forward from the keys and
    the query; the profile bounds the prompts served to those whose every query keeps all its keys.
    """

    has_static_form = False  # a static indexed layer is not one plain buffer
    defers_keys = False  # landing at first use is for plain full attention alone

    def capture_kv(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        # Indexer keys here would be state this adapter does not store: refuse rather than lose them.
        if layer.indexer_keys is not None or layer.indexer_position_ids is not None:
            raise InconsistentStateError("indexer keys in a key-indexed layer: they would be lost to the store")
        return super().capture_kv(layer)
