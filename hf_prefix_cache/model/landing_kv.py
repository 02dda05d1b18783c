"""LandingKV: the layers of a restored `WorkingCache` still waiting for their keys (copies from host memory landing).

A restore that overlaps the prefill sets each attention layer to stand-ins of the right shape, and
this object sets the real keys when a layer is first read (`set_layer`) or updated (`set_head`):
the layer's copies are waited for only then. Used by `working_cache.WorkingCache` only.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from transformers import Cache, DynamicCache

from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.model.landing import Landing

#: Per piece of a restored prefix: its keys and its values, per layer (None for layers without keys).
KVPieces = Sequence[tuple[Sequence[torch.Tensor | None], Sequence[torch.Tensor | None]]]


# Cache methods that read no key/value data (shapes and flags at most): they may run before a landing layer is set.
_READS_NO_DATA = frozenset(
    {
        "update",  # lands its own layer first (`_update_landing`)
        "get_seq_length",
        "get_mask_sizes",
        "get_max_length",
        "get_query_offset",
        "has_previous_state",
        "is_recording_past",
        "activate_past_recording",
        "get_recurrent_states_to_keep",  # 5.25
        "increase_count",  # 5.25: a linear layer's token counter
    }
)
# Every other public Cache method lands every layer before it runs (in transformers 5.23-5.25: crop,
# reorder_cache, batch_repeat_interleave, batch_select_indices, offload, prefetch, reset, ...).
LANDS_ALL = tuple(
    sorted(
        name
        for cls in (Cache, DynamicCache)
        for name, attr in vars(cls).items()
        if not name.startswith("_") and inspect.isfunction(attr) and name not in _READS_NO_DATA
    )
)


class LandingKV:
    """The layers of a `WorkingCache` still waiting for their keys, and what sets each of them."""

    def __init__(self, cache: Any, length: int, pieces: KVPieces, landing: Landing | None, batch_size: int) -> None:
        self.cache = cache
        self.length = length
        self.pieces = pieces
        self.landing = landing
        self.batch_size = batch_size
        self.pending: set[int] = set()
        stand_ins: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        for i, (layer, adapter) in enumerate(zip(cache.layers, cache.profile.adapters, strict=True)):
            if not adapter.has_kv:
                continue
            k, v = pieces[0][0][i], pieces[0][1][i]
            if k is None or v is None:
                raise InconsistentStateError(f"layer {i} has no stored keys")
            where = (k.device, k.dtype)
            if where not in stand_ins:
                stand_ins[where] = torch.full((), float("nan"), dtype=k.dtype, device=k.device)
            shape_k = (batch_size, *k.shape[1:-2], length, k.shape[-1])
            shape_v = (batch_size, *v.shape[1:-2], length, v.shape[-1])
            adapter.restore_kv(layer, stand_ins[where].expand(shape_k), stand_ins[where].expand(shape_v), length)
            self.pending.add(i)

    def _take(self, i: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Wait for layer `i`'s copies; its pieces of keys and of values."""
        self.pending.discard(i)
        if self.landing is not None:
            self.landing.ready(i)
        ks: list[torch.Tensor] = [p[0][i] for p in self.pieces]  # type: ignore[misc]
        vs: list[torch.Tensor] = [p[1][i] for p in self.pieces]  # type: ignore[misc]
        return ks, vs

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        """`t` broadcast to every row of the batch (a view)."""
        return t if self.batch_size == 1 else t.expand(self.batch_size, -1, -1, -1)

    def set_layer(self, i: int) -> None:
        """Wait for layer `i`'s copies, join its pieces and set them in the layer."""
        ks, vs = self._take(i)
        k = ks[0] if len(ks) == 1 else torch.cat(ks, dim=-2)
        v = vs[0] if len(vs) == 1 else torch.cat(vs, dim=-2)
        self.cache.profile.adapters[i].restore_kv(self.cache.layers[i], self._rows(k), self._rows(v), self.length)

    def set_head(
        self, i: int, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `i`'s first update: set its first piece, and return its other pieces followed by the new states.

        The layer's `update` then concatenates the first piece with what this returns: the keys
        it keeps and hands to attention are the whole prefix and the new states, as ever.
        """
        ks, vs = self._take(i)
        head_k, head_v = self._rows(ks[0]), self._rows(vs[0])
        self.cache.profile.adapters[i].restore_kv(self.cache.layers[i], head_k, head_v, ks[0].shape[-2])
        if len(ks) > 1:
            key_states = torch.cat([*map(self._rows, ks[1:]), key_states], dim=-2)
            value_states = torch.cat([*map(self._rows, vs[1:]), value_states], dim=-2)
        return key_states, value_states
