"""Registry from transformers cache layer class to its adapter.

One table, `ADAPTERS`: each row names a layer class and gives the adapter for a layer of it,
from the options the profile passes (`LayerOptions`). What an adapter can do is declared by its
class (`base.LayerAdapter`), so nothing outside this package names a concrete adapter.

Lookup is by exact class: a subclass may add state an adapter does not know (an indexer,
a quantized copy), so an unregistered class is refused with its name rather than guessed.
Cross-attention layers share their class with full attention; the profile says which layers
hold media items (from the media adapter), and their row gives `CrossAttentionAdapter` for them.
Layer classes of one model family (DeepSeek-V4's) are named by module and class, so that no
model module is imported to look them up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

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
from hf_prefix_cache.model.layers.indexed import IndexedAttentionAdapter, KeyIndexedAttentionAdapter
from hf_prefix_cache.model.layers.recurrent import HybridAdapter, HybridSlidingAdapter, RecurrentAdapter
from hf_prefix_cache.model.layers.sliding import SlidingWindowAdapter, WindowStateAdapter

SLIDING_WINDOW_MODES = ("every_position", "window")


class LayerOptions(NamedTuple):
    """How the profile wants one layer served; every row reads what concerns it."""

    #: `"window"` keeps sliding layers as window snapshots instead of every position (`layers/sliding.py`).
    sliding_window_mode: str = "every_position"
    #: Width of an indexed layer's indexer keys (the config's `index_head_dim`); without it none is served.
    index_dim: int | None = None
    #: The layer keeps its indexers' positions too (Qwen4-Exp's first indexed layer).
    keeps_indexer_positions: bool = False
    #: The layer holds media items (a cross-attention layer, named by the media adapter).
    holds_items: bool = False
    #: An indexed layer keeps no indexer keys: its indexers rank the layer's own keys (Kolibri 1.1).
    indexes_keys: bool = False


_FULL, _CROSS, _NO_CACHE = FullAttentionAdapter(), CrossAttentionAdapter(), NoCacheAdapter()
_SLIDING, _WINDOW, _KEY_INDEXED = SlidingWindowAdapter(), WindowStateAdapter(), KeyIndexedAttentionAdapter()
_RECURRENT, _HYBRID, _HYBRID_SLIDING = RecurrentAdapter(), HybridAdapter(), HybridSlidingAdapter()
_DEEPSEEK_V4 = "transformers.models.deepseek_v4.modeling_deepseek_v4"

#: Layer class, or `module.ClassName` for classes of a model's own module -> the adapter for a layer of it, or None
#: where these options are not served. Adapters without per-layer settings are shared.
ADAPTERS: dict[type | str, Callable[[Any, LayerOptions], LayerAdapter | None]] = {
    DynamicLayer: lambda layer, o: _CROSS if o.holds_items else _FULL,
    DynamicSlidingWindowLayer: lambda layer, o: _WINDOW if o.sliding_window_mode == "window" else _SLIDING,
    DynamicIndexedLayer: lambda layer, o: (
        IndexedAttentionAdapter(o.index_dim, keeps_positions=o.keeps_indexer_positions)
        if o.index_dim is not None
        else _KEY_INDEXED
        if o.indexes_keys
        else None
    ),
    LinearAttentionLayer: lambda layer, o: _RECURRENT,
    LinearAttentionAndFullAttentionLayer: lambda layer, o: _HYBRID,
    # Its window cannot be snapshotted apart from its recurrent state: every position, in both modes.
    LinearAttentionAndSlidingWindowAttentionLayer: lambda layer, o: _HYBRID_SLIDING,
    DummyLayer: lambda layer, o: _NO_CACHE,
    f"{_DEEPSEEK_V4}.DeepseekV4HCACache": lambda layer, o: CompressedAttentionAdapter(),
    # Its indexer ranks compressed entries of `compress_rate` tokens each.
    f"{_DEEPSEEK_V4}.DeepseekV4CSACache": lambda layer, o: CompressedAttentionAdapter(int(layer.compress_rate)),
}


def adapter_for(
    layer: Any,
    sliding_window_mode: str = "every_position",
    index_dim: int | None = None,
    *,
    keeps_indexer_positions: bool = False,
    holds_items: bool = False,
    indexes_keys: bool = False,
) -> LayerAdapter | None:
    """The adapter for `layer`'s exact class, or None when the class (or, with these options, the layer) is not
    supported.

    `sliding_window_mode="window"` keeps sliding layers as window snapshots instead of every position.
    `index_dim` is the width of an indexed layer's indexer keys (the config's `index_head_dim`):
    without it such a layer is not supported. `keeps_indexer_positions`: an indexed layer keeps its indexers'
    positions too. `holds_items`: the layer holds media items (cross-attention); only a plain `DynamicLayer` does.
    `indexes_keys`: an indexed layer without `index_dim` keeps no indexer keys (its indexers rank its keys).

    >>> from transformers.cache_utils import DynamicLayer, StaticLayer
    >>> adapter_for(DynamicLayer()).has_kv, adapter_for(DynamicLayer(), holds_items=True).holds_items
    (True, True)
    >>> adapter_for(StaticLayer(max_cache_len=8)) is None
    True
    """
    cls = type(layer)
    row = ADAPTERS.get(cls) or ADAPTERS.get(f"{cls.__module__}.{cls.__qualname__}")
    if row is None:
        return None
    adapter = row(
        layer, LayerOptions(sliding_window_mode, index_dim, keeps_indexer_positions, holds_items, indexes_keys)
    )
    return adapter if adapter is None or adapter.holds_items == holds_items else None


__all__ = ["ADAPTERS", "SLIDING_WINDOW_MODES", "LayerAdapter", "LayerOptions", "LayerState", "adapter_for"]
