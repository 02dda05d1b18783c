"""LayerAdapter: how one kind of transformers cache layer is captured and restored.

An adapter knows one layer class's attributes and nothing about the store or the tree.
Each adapter class declares what it can do as class attributes (`LayerAdapter` lists them, all
False or None unless a class says otherwise), so the working cache and the profile ask for a
capability and never for a class. The two that decide how a layer is stored:

- `has_kv`: the layer keeps per-token keys and values. The store keeps them for every
  position, so they restore to any length by slicing (`trim` is a slice).
- `has_state`: the layer keeps a recurrent or convolution state that summarises all tokens
  so far. It cannot be rewound; it restores only from a snapshot taken at exactly the wanted
  length (a window state, `restores_below_length`, also below it).

The others are documented where `LayerAdapter` declares them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class LayerState:
    """A cloned recurrent/conv state of one layer; `tensors` maps attribute -> index -> tensor."""

    tensors: dict[str, dict[int, torch.Tensor | None]]
    flags: dict[str, dict[int, Any]]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for per_idx in self.tensors.values() for t in per_idx.values() if t is not None)


class LayerAdapter(ABC):
    """Capture and restore one transformers cache layer class; its capabilities, declared by the class.

    Every adapter has the five abstract verbs; the verbs after them are there only where the capability
    their docstring names is True (elsewhere they raise), so the working cache asks for it first.
    """

    #: Per-token keys and values, stored at every position and restored by slicing (`capture_kv`, `restore_kv`).
    has_kv: bool = False
    #: A state snapshotted at chosen lengths (`snapshot_state`, `restore_state`).
    has_state: bool = False
    #: The state summarises every token so far, not only a window: it restores only at its exact length, and
    #: snapshots at intervals pay for themselves (`ModelProfile.has_recurrence`).
    has_recurrence: bool = False
    #: The state is tensors whose first dimension is the batch, read by reference (`state_refs`) and set as given
    #: (`load_state`): many layers' states clone in one copy, rows prefilled alone join (`recurrent.join_rows`)
    #: and one row copies out (`recurrent.select_row`).
    has_state_refs: bool = False
    #: A window state: restores below its snapshot's length (`at`), and two touching snapshots merge into one
    #: (`extend`).
    restores_below_length: bool = False
    #: transformers' own `crop` (assisted decoding drops rejected candidates with it) leaves the layer as a
    #: forward of the shorter sequence would, and still capturable.
    is_croppable: bool = False
    #: transformers' static counterpart of the layer (`cache_implementation="static"`) is a plain key/value
    #: buffer, into which a restored prefix can be copied (`model/static.py`).
    has_static_form: bool = False
    #: Keeps positions `[0, length)` of chosen batch rows (`trim`), for a cache that is only read afterwards.
    is_trimmable: bool = False
    #: Plain full attention: the layer's keys are read only through `update` (in layer order) and the `Cache`
    #: methods, so they may be set at their first use (`WorkingCache.restore(landing=...)`).
    defers_keys: bool = False
    #: Holds keys/values of media items, not of tokens (cross-attention): never sliced by text length, captured
    #: and restored per item (`capture_media`, `restore_media`).
    holds_items: bool = False
    #: Keeps an indexer's keys per token (sparse attention with an indexer, `DynamicIndexedLayer`).
    has_indexer_keys: bool = False
    #: Keeps positions of its own (Qwen4-Exp's indexers), which a restore rebuilds as `0..length-1`.
    keeps_positions: bool = False
    #: Tokens one compressed entry covers, where an indexer ranks the layer's entries (DeepSeek-V4's CSA layers).
    entry_tokens: int | None = None
    #: A fresh layer must be set up (`prepare`) before the model runs on it.
    needs_prepare: bool = False

    @abstractmethod
    def prepare(self, layer: Any) -> None:
        """Set a fresh layer up so that a later `capture_kv` sees every position (where `needs_prepare`)."""

    @abstractmethod
    def capture_kv(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys and values `[B, H, L, D]` for all positions `[0, L)`, by reference (no copy)."""

    @abstractmethod
    def restore_kv(self, layer: Any, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Make a fresh `layer` hold `keys`/`values` for positions `[0, length)`."""

    @abstractmethod
    def snapshot_state(self, layer: Any) -> LayerState | None:
        """Clone the layer's recurrent state (it is mutated in place by later forwards)."""

    @abstractmethod
    def restore_state(self, layer: Any, state: LayerState) -> None:
        """Load a clone of `state` into a fresh `layer`."""

    def trim(self, layer: Any, length: int, rows: torch.Tensor) -> None:
        """Keep positions `[0, length)` of batch `rows`, copied out (where `is_trimmable`)."""
        raise AssertionError(f"{type(self).__name__} layers do not trim")

    def state_refs(self, layer: Any) -> LayerState:
        """The layer's state tensors by reference (where `has_state_refs`)."""
        raise AssertionError(f"{type(self).__name__} layers have no state by reference")

    def load_state(self, layer: Any, state: LayerState) -> None:
        """Make `layer` hold `state` itself, a clone the caller made and gives away (where `has_state_refs`)."""
        raise AssertionError(f"{type(self).__name__} layers have no state by reference")

    @staticmethod
    def at(state: LayerState, length: int) -> LayerState:
        """The state after exactly `length` tokens, cut from a later one (where `restores_below_length`)."""
        raise AssertionError("only window states restore below their length")

    @staticmethod
    def extend(earlier: LayerState, later: LayerState) -> LayerState | None:
        """One state restoring any length from `earlier`'s to `later`'s, or None when they do not touch (where
        `restores_below_length`)."""
        raise AssertionError("only window states merge")

    def capture_media(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys and values `[B, H, N, D]` of every media item seen, or None when empty (where `holds_items`)."""
        raise AssertionError(f"{type(self).__name__} layers hold no media items")

    def restore_media(self, layer: Any, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Make a fresh `layer` hold the keys/values `[B, H, N, D]` of the restored items (where `holds_items`)."""
        raise AssertionError(f"{type(self).__name__} layers hold no media items")


class NoCacheAdapter(LayerAdapter):
    """`DummyLayer` (KV-sharing consumers, MLP-only layers): nothing per token, nothing to snapshot."""

    is_croppable = True  # `DummyLayer.crop` does nothing, and there is nothing to keep

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
