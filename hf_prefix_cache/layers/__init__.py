"""Registry from transformers cache layer class to its adapter.

Lookup is by exact class: a subclass may add state an adapter does not know (an indexer,
a quantized copy), so an unregistered class is refused with its name rather than guessed.
Cross-attention layers share their class with full attention; the profile picks
`CrossAttentionAdapter` for them by index, from the media adapter.
"""

from __future__ import annotations

from typing import Any

from transformers.cache_utils import (
    DummyLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionLayer,
)

from .base import LayerAdapter, LayerState, NoCacheAdapter
from .cross import CrossAttentionAdapter
from .full import FullAttentionAdapter
from .recurrent import HybridAdapter, RecurrentAdapter
from .sliding import SlidingWindowAdapter

ADAPTERS: dict[type, LayerAdapter] = {
    DynamicLayer: FullAttentionAdapter(),
    DynamicSlidingWindowLayer: SlidingWindowAdapter(),
    LinearAttentionLayer: RecurrentAdapter(),
    LinearAttentionAndFullAttentionLayer: HybridAdapter(),
    DummyLayer: NoCacheAdapter(),
}


def adapter_for(layer: Any) -> LayerAdapter | None:
    """The adapter for `layer`'s exact class, or None when the class is not supported."""
    return ADAPTERS.get(type(layer))


__all__ = ["ADAPTERS", "CrossAttentionAdapter", "LayerAdapter", "LayerState", "adapter_for"]
