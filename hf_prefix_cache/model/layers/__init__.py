"""Registry from transformers cache layer class to its adapter.

Lookup is by exact class: a subclass may add state an adapter does not know (an indexer,
a quantized copy), so an unregistered class is refused with its name rather than guessed.
Cross-attention layers share their class with full attention; the profile picks
`CrossAttentionAdapter` for them by index, from the media adapter. Layer classes of one model
family (DeepSeek-V4's) are named by module and class (`FAMILY_ADAPTERS`), so that no model module
is imported to look them up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers.cache_utils import (
    DummyLayer,
    DynamicIndexedLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionLayer,
)

from hf_prefix_cache.model.layers.base import LayerAdapter, LayerState, NoCacheAdapter
from hf_prefix_cache.model.layers.compressed import CompressedAttentionAdapter
from hf_prefix_cache.model.layers.cross import CrossAttentionAdapter
from hf_prefix_cache.model.layers.full import FullAttentionAdapter
from hf_prefix_cache.model.layers.indexed import IndexedAttentionAdapter
from hf_prefix_cache.model.layers.recurrent import HybridAdapter, HybridSlidingAdapter, RecurrentAdapter
from hf_prefix_cache.model.layers.sliding import SlidingWindowAdapter, WindowStateAdapter

ADAPTERS: dict[type, LayerAdapter] = {
    DynamicLayer: FullAttentionAdapter(),
    DynamicSlidingWindowLayer: SlidingWindowAdapter(),
    LinearAttentionLayer: RecurrentAdapter(),
    LinearAttentionAndFullAttentionLayer: HybridAdapter(),
    LinearAttentionAndSlidingWindowAttentionLayer: HybridSlidingAdapter(),
    DummyLayer: NoCacheAdapter(),
}

_DEEPSEEK_V4 = "transformers.models.deepseek_v4.modeling_deepseek_v4"
#: Layer classes defined in a model's own module, by `module.ClassName`: each gives its adapter for a layer.
FAMILY_ADAPTERS: dict[str, Callable[[Any], LayerAdapter]] = {
    f"{_DEEPSEEK_V4}.DeepseekV4HCACache": lambda layer: CompressedAttentionAdapter(),
    # Its indexer ranks compressed entries of `compress_rate` tokens each.
    f"{_DEEPSEEK_V4}.DeepseekV4CSACache": lambda layer: CompressedAttentionAdapter(int(layer.compress_rate)),
}

SLIDING_WINDOW_MODES = ("every_position", "window")


def adapter_for(
    layer: Any, sliding_window_mode: str = "every_position", index_dim: int | None = None
) -> LayerAdapter | None:
    """The adapter for `layer`'s exact class, or None when the class is not supported.

    `sliding_window_mode="window"` keeps sliding layers as window snapshots instead of every position.
    `index_dim` is the width of an indexed layer's indexer keys (the config's `index_head_dim`):
    without it such a layer is not supported.
    """
    if sliding_window_mode == "window" and type(layer) is DynamicSlidingWindowLayer:
        return WindowStateAdapter()
    if type(layer) is DynamicIndexedLayer:
        return IndexedAttentionAdapter(index_dim) if index_dim is not None else None
    family = FAMILY_ADAPTERS.get(f"{type(layer).__module__}.{type(layer).__qualname__}")
    return family(layer) if family is not None else ADAPTERS.get(type(layer))


__all__ = ["ADAPTERS", "SLIDING_WINDOW_MODES", "CrossAttentionAdapter", "LayerAdapter", "LayerState", "adapter_for"]
