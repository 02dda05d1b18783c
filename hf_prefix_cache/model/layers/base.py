"""LayerAdapter: how one kind of transformers cache layer is captured and restored.

An adapter knows one layer class's attributes and nothing about the store or the tree.
Two capabilities, declared up front rather than discovered by trial:

- `has_kv`: the layer keeps per-token keys and values. The store keeps them for every
  position, so they restore to any length by slicing (`trim` is a slice).
- `has_state`: the layer keeps a recurrent or convolution state that summarises all tokens
  so far. It cannot be rewound (`is_trimmable` is False); it restores only from a snapshot
  taken at exactly the wanted length.
- `is_croppable`: transformers' own `crop` (assisted decoding drops rejected candidates with
  it) leaves the layer as a forward of the shorter sequence would, and still capturable.
- `has_static_form`: transformers' static counterpart of the layer (`cache_implementation="static"`)
  is a plain key/value buffer, into which a restored prefix can be copied (`model/static.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True, slots=True)
class LayerState:
    """A cloned recurrent/conv state of one layer; `tensors` maps attribute -> index -> tensor."""

    tensors: dict[str, dict[int, torch.Tensor | None]]
    flags: dict[str, dict[int, Any]]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for per_idx in self.tensors.values() for t in per_idx.values() if t is not None)


class LayerAdapter(Protocol):
    """Capture and restore one transformers cache layer class."""

    has_kv: bool
    has_state: bool
    is_croppable: bool
    has_static_form: bool

    def capture_kv(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys and values `[B, H, L, D]` for all positions `[0, L)`, by reference (no copy)."""
        ...

    def restore_kv(self, layer: Any, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Make a fresh `layer` hold `keys`/`values` for positions `[0, length)`."""
        ...

    def snapshot_state(self, layer: Any) -> LayerState | None:
        """Clone the layer's recurrent state (it is mutated in place by later forwards)."""
        ...

    def restore_state(self, layer: Any, state: LayerState) -> None:
        """Load a clone of `state` into a fresh `layer`."""
        ...

    def prepare(self, layer: Any) -> None:
        """Set a fresh layer up so that a later `capture_kv` sees every position."""
        ...


class NoCacheAdapter:
    """`DummyLayer` (KV-sharing consumers, MLP-only layers): nothing per token, nothing to snapshot."""

    has_kv = False
    has_state = False
    is_croppable = True  # `DummyLayer.crop` does nothing, and there is nothing to keep
    has_static_form = False

    def prepare(self, layer: Any) -> None:
        pass

    def capture_kv(self, layer: Any) -> None:
        return None

    def restore_kv(self, layer: Any, keys: Any, values: Any, length: int) -> None:
        raise AssertionError(f"{type(self).__name__} layers hold no per-token keys nor states")

    def snapshot_state(self, layer: Any) -> None:
        return None

    def restore_state(self, layer: Any, state: LayerState) -> None:
        raise AssertionError(f"{type(self).__name__} layers hold no per-token keys nor states")
