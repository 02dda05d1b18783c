"""Static caches (`cache_implementation="static"`, the `torch.compile` path): a restored prefix copied into
transformers' preallocated buffers, and the finished sequence copied back out to be stored.

A `StaticCache` keeps each layer's keys in one buffer of `max_cache_len` positions, written in
place at `cumulative_length` (a tensor, so that compiled graphs do not recompile as it grows). A
restore allocates the buffers as the layer's first `update` would, copies the prefix into their
first positions and sets the length; after `generate`, the positions written are copied out into
a `WorkingCache`, since the buffers belong to this call. Every row is copied as it lies: a batch
restored row by row (zeros behind left padding), or one prompt copied for its beams or samples.

A static sliding-window layer (`StaticSlidingWindowLayer`, also what the deprecated
``"sliding_window"`` and ``"hybrid"`` implementations build) keeps only the last `window`
positions, in order, and counts every position seen in a Python int (`cumulative_length_int`;
its tensor length stops once the window is full and is not read after). A restore puts the
prefix's last `window` positions (all of them when shorter) where the layer's own updates would
have left them. Once a call has written past the window the earlier positions are gone, so its
sequence cannot be copied out: `from_static` answers None and the request stores nothing.
Only for models whose cache layers all have a static form (`ModelProfile.serves_static`): full
attention and sliding windows kept at every position; indexed static layers keep other state.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import StaticCache

from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.model.working_cache import WorkingCache


def to_static(working: WorkingCache, config: Any, max_cache_len: int) -> StaticCache:
    """A `StaticCache` of `max_cache_len` positions holding what `working` holds (its restored prefix, maybe none)."""
    assert working.profile.serves_static, "static caches are for models whose every layer is full attention"
    working.land()
    static = StaticCache(config=config, max_cache_len=max_cache_len)
    layers: list[Any] = static.layers
    for i, (layer, adapter) in enumerate(zip(working.layers, working.profile.adapters, strict=True)):
        kv = adapter.capture_kv(layer) if adapter.has_kv else None
        if kv is None:
            continue
        keys, values = kv
        length = keys.shape[-2]
        if length > max_cache_len:
            raise InconsistentStateError(f"a prefix of {length} positions in a static cache of {max_cache_len}")
        target = layers[i]
        target.lazy_initialization(keys, values)  # reads shapes, dtype and device only
        kept = min(length, target.max_cache_len)  # a sliding layer's buffer is its window
        target.keys[:, :, :kept].copy_(keys[:, :, length - kept :])
        target.values[:, :, :kept].copy_(values[:, :, length - kept :])
        if length <= target.max_cache_len:
            target.cumulative_length.fill_(length)  # a sliding layer stops counting here once full, as its updates do
        if _is_sliding(target):
            target.cumulative_length_int = length
    return static


def from_static(static: StaticCache, working: WorkingCache) -> WorkingCache | None:
    """A new `WorkingCache` (of `working`'s model) holding copies of every position `static` holds; None when a
    sliding layer has written past its window (its earliest positions are gone)."""
    out = WorkingCache(working.profile)
    layers: list[Any] = static.layers
    for layer, fresh, adapter in zip(layers, out.layers, working.profile.adapters, strict=True):
        if not adapter.has_kv or not layer.is_initialized:
            continue
        length = int(layer.get_seq_length())
        if length > layer.max_cache_len:
            return None
        keys: torch.Tensor = layer.keys[:, :, :length].clone()
        values: torch.Tensor = layer.values[:, :, :length].clone()
        adapter.restore_kv(fresh, keys, values, length)
    return out


def _is_sliding(layer: Any) -> bool:
    """Whether a static layer is a sliding window (its length is also kept as a Python int)."""
    return bool(getattr(layer, "is_sliding", False)) and hasattr(layer, "cumulative_length_int")
