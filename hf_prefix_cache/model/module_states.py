"""Recurrence kept in module attributes (RecurrentGemma): moved into the working cache's layers around each forward.

RecurrentGemma's recurrent blocks keep their state on themselves (`conv1d_state`, the last
`conv1d_width - 1` inputs of the temporal convolution, and `rg_lru.recurrent_states`), not in the
`Cache`; transformers' layout for its config still gives those blocks `LinearAttentionLayer`s,
which the model leaves empty. `ModuleStateBridge` hooks the decoder: before a forward on a
working cache it hands each block the state its layer holds (none: the block starts from zeros,
as a cold prefill does), and after it puts the blocks' new state into the layers, so the store
snapshots and restores them as any recurrent layer's (`layers/recurrent.py`). The blocks never
write a state in place (each step makes new tensors), so the layers' tensors are shared, not copied.

A multi-token forward of these blocks starts their convolution from zeros, whatever state they
hold (only a one-token forward reads `conv1d_state`), so a continuation after a restored state
is fed one token per forward (`ModelProfile.single_token_steps`), as generation decodes.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hf_prefix_cache import _compat

#: Model types whose recurrent blocks keep their state in module attributes.
MODULE_STATE_MODEL_TYPES = frozenset({"recurrent_gemma"})


def _blocks(model: nn.Module) -> tuple[nn.Module | None, list[tuple[int, Any]]]:
    """The decoder whose forward takes the cache, and its recurrent blocks by layer index (RecurrentGemma's layout)."""
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if callable(getattr(module, "_setup_cache", None)) and isinstance(layers, nn.ModuleList):
            blocks = [
                (i, block)
                for i, layer in enumerate(layers)
                if hasattr(block := getattr(layer, "temporal_block", None), "conv1d_state") and hasattr(block, "rg_lru")
            ]
            return module, blocks
    return None, []


def has_module_states(model: nn.Module) -> bool:
    """Whether `model`'s module-kept states are where the bridge looks for them."""
    return bool(_blocks(model)[1])


class ModuleStateBridge:
    """Hooks on a RecurrentGemma decoder that keep its blocks' state in the working cache it runs on.

    Example:
        >>> from hf_prefix_cache.model.working_cache import WorkingCache
        >>> ModuleStateBridge.install(nn.Linear(2, 2), WorkingCache) is None  # no module-kept state
        True
    """

    def __init__(self, decoder: nn.Module, blocks: list[tuple[int, Any]], cache_type: type) -> None:
        self._blocks = blocks
        self._cache_type = cache_type
        self._handles = [
            decoder.register_forward_pre_hook(self._load, with_kwargs=True),
            decoder.register_forward_hook(self._save, with_kwargs=True),
        ]

    @classmethod
    def install(cls, model: nn.Module, cache_type: type) -> ModuleStateBridge | None:
        """Bridge `model`'s module-kept states into caches of `cache_type` (None when it keeps none)."""
        decoder, blocks = _blocks(model)
        return cls(decoder, blocks, cache_type) if decoder is not None and blocks else None

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _cache(self, kwargs: dict[str, Any]) -> Any:
        cache = _compat.cache_in(kwargs)
        return cache if isinstance(cache, self._cache_type) else None

    def _load(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cache = self._cache(kwargs)
        if cache is None:
            return
        for i, block in self._blocks:
            layer = cache.layers[i]
            held = layer.is_recurrent_states_initialized[0]
            # None: the block makes zeros of the call's batch, as a cold prefill starts from.
            block.conv1d_state = layer.conv_states[0] if held else None
            block.rg_lru.recurrent_states = layer.recurrent_states[0] if held else None

    def _save(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        cache = self._cache(kwargs)
        if cache is None:
            return
        for i, block in self._blocks:
            layer, conv, state = cache.layers[i], block.conv1d_state, block.rg_lru.recurrent_states
            if conv is None or state is None:
                continue  # a forward without use_cache keeps nothing
            layer.conv_states[0], layer.recurrent_states[0] = conv, state
            layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
            layer.has_previous_state[0] = True
            layer.dtype, layer.device = conv.dtype, conv.device
