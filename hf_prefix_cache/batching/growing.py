"""GrowingCache: the running batch's working cache, whose full-attention layers take each step's keys in place.

transformers' `DynamicLayer.update` concatenates every step: the whole batch's keys and values are copied
to take one new column, which on a CPU costs more than the attention that reads them (44% of a 4-row
SmolLM2 step at 1,500 tokens). Here a plain full-attention layer (exactly `DynamicLayer`) writes the new
columns into a buffer with spare room, and its `keys` and `values` stay views of that buffer's filled
columns: one copy when the buffer is first made or outgrown (`SPARE` columns at a time), none per step.
Every other layer (sliding windows, recurrent states) updates as transformers does. The layers' contents,
and so every logit, are those a concatenation gives.

Example:
    >>> from hf_prefix_cache.api.prefix_cache import store_of
    >>> cache = GrowingCache(store_of(store).profile)
    >>> _ = model(ids, past_key_values=cache, use_cache=True)
    >>> _ = model(ids[:, :1], past_key_values=cache, use_cache=True)
    >>> cache.layers[0].keys.shape[-2], cache.spare(0) == SPARE
    (37, True)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import DynamicLayer

from hf_prefix_cache.model.working_cache import WorkingCache

if TYPE_CHECKING:
    from hf_prefix_cache.model.profile import ModelProfile

#: Spare columns a layer's buffer is made with: it is copied once per this many steps at most.
SPARE = 64


class GrowingCache(WorkingCache):
    """A `WorkingCache` whose plain full-attention layers grow in place (see the module's docstring)."""

    def __init__(self, profile: ModelProfile) -> None:
        super().__init__(profile)
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by layer: its keys' and values' room

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `Cache.update`; a plain full-attention layer writes the new columns into its buffer."""
        layer = self.layers[layer_idx]
        old_keys, old_values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if type(layer) is not DynamicLayer or not layer.is_initialized or old_keys is None or old_values is None:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        held, new = old_keys.shape[-2], key_states.shape[-2]
        kept = self._buffers.get(layer_idx)
        if kept is None or not (_fills(kept[0], old_keys, held + new) and _fills(kept[1], old_values, held + new)):
            kept = (_room(old_keys, held + new + SPARE), _room(old_values, held + new + SPARE))
            self._buffers[layer_idx] = kept
        keys, values = kept
        keys[:, :, held : held + new] = key_states
        values[:, :, held : held + new] = value_states
        layer.keys, layer.values = keys[:, :, : held + new], values[:, :, : held + new]
        return layer.keys, layer.values

    def spare(self, layer_idx: int) -> int:
        """Columns layer `layer_idx`'s buffer can still take before it is copied (0 where it has none)."""
        kept = self._buffers.get(layer_idx)
        keys = getattr(self.layers[layer_idx], "keys", None)
        return 0 if kept is None or keys is None else kept[0].shape[-2] - keys.shape[-2]


def _fills(buffer: torch.Tensor, held: torch.Tensor, needed: int) -> bool:
    """Whether `held` is the filled start of `buffer` (the same rows and memory) and `buffer` has `needed` columns."""
    return (
        buffer.shape[-2] >= needed
        and held.data_ptr() == buffer.data_ptr()
        and held.shape[:2] == buffer.shape[:2]
        and held.stride() == buffer.stride()
    )


def _room(held: torch.Tensor, columns: int) -> torch.Tensor:
    """A buffer of `columns` columns whose start is a copy of `held`."""
    buffer = held.new_empty((*held.shape[:2], columns, held.shape[-1]))
    buffer[:, :, : held.shape[-2]] = held
    return buffer
