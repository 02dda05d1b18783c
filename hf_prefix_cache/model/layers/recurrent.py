"""Linear attention, SSM and short-conv layers (`LinearAttentionLayer` and its hybrids).

Their conv and recurrent states are updated in place (`copy_`) and summarise every token
seen so far, so they cannot be trimmed: the store keeps cloned snapshots taken at chosen
positions, and a restore loads a fresh clone so the snapshot stays untouched.
Hybrid layers carry keys too: those of `LinearAttentionAndFullAttentionLayer` are handled as
full attention, those of `LinearAttentionAndSlidingWindowAttentionLayer` as a sliding layer
that records every position (in both sliding-window modes: its window cannot be snapshotted
apart from its recurrent state).

A batch whose rows were prefilled one by one is joined row-wise (`join_rows`: each row's state,
zeros for a row that has seen no token yet, repeated for beams or several sequences), and one
row is copied out to be stored alone (`select_row`): a state's first dimension is the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from hf_prefix_cache._compat import LINEAR_LAYERS_CROP
from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.model.layers.base import LayerAdapter, LayerState
from hf_prefix_cache.model.layers.full import FullAttentionAdapter
from hf_prefix_cache.model.layers.sliding import SlidingWindowAdapter

_STATE_TENSORS = ("conv_states", "recurrent_states")
_STATE_FLAGS = (
    "is_conv_states_initialized",
    "is_recurrent_states_initialized",
    "has_previous_state",
    "conv_kernel_size",
)


class RecurrentAdapter(LayerAdapter):
    has_state = True
    has_recurrence = True
    has_state_refs = True  # `state_refs`, `load_state`
    # A state summarises every token: before 5.25 it cannot go back; from 5.25 transformers' `crop` rolls it back
    # through the states it recorded for assisted decoding's candidates (`activate_past_recording`).
    is_croppable = LINEAR_LAYERS_CROP

    def prepare(self, layer: Any) -> None:
        pass

    def capture_kv(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None

    def restore_kv(self, layer: Any, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        raise AssertionError("recurrent layers have no keys")

    def snapshot_state(self, layer: Any) -> LayerState | None:
        return clone_states([self.state_refs(layer)])[0]

    def state_refs(self, layer: Any) -> LayerState:
        """The layer's state tensors by reference (the working cache clones many layers' at once)."""
        tensors = {name: dict(getattr(layer, name)) for name in _STATE_TENSORS}
        flags = {name: dict(getattr(layer, name)) for name in _STATE_FLAGS}
        return LayerState(tensors=tensors, flags=flags)

    def restore_state(self, layer: Any, state: LayerState) -> None:
        self.load_state(layer, clone_states([state])[0])

    def load_state(self, layer: Any, state: LayerState) -> None:
        """Make `layer` hold `state` itself (a clone the caller made and gives away)."""
        for name, per_idx in state.tensors.items():
            setattr(layer, name, dict(per_idx))
        for name, per_idx in state.flags.items():
            setattr(layer, name, dict(per_idx))
        first = next((t for per in state.tensors.values() for t in per.values() if t is not None), None)
        if first is not None:
            layer.dtype, layer.device = first.dtype, first.device


def join_rows(states: Sequence[LayerState | None], repeats: int = 1) -> LayerState:
    """One batch's state from per-row `states` (one row each), in order, each row repeated `repeats` times (copies).

    A row given None, or whose tensor at an index is missing, has seen no token: it gets zeros, which the
    layers treat as a fresh state (an empty conv window, a zero recurrence). Flags come from the rows that
    have the state.
    """
    given = [s for s in states if s is not None]
    assert given, "a join needs at least one row with a state"
    tensors: dict[str, dict[int, torch.Tensor | None]] = {}
    for name in given[0].tensors:
        tensors[name] = {}
        for idx in given[0].tensors[name]:
            rows = [s.tensors[name].get(idx) if s is not None else None for s in states]
            template = next((t for t in rows if t is not None), None)
            if template is None:
                tensors[name][idx] = None
                continue
            if not all(t is None or t.shape[0] == 1 for t in rows):
                raise InconsistentStateError(f"{name}[{idx}]: rows of one batch row each")
            # Conv states that record their past (`activate_past_recording`, hybrid sliding layers) are as long as
            # their row: shorter rows get zeros in front, the inputs their masked padding gives a cold batch.
            width = max(t.shape[-1] for t in rows if t is not None)
            joined = torch.cat(
                [F.pad(t, (width - t.shape[-1], 0)) if t is not None else _zeros(template, width) for t in rows]
            )
            tensors[name][idx] = joined.repeat_interleave(repeats, dim=0) if repeats > 1 else joined
    flags: dict[str, dict[int, Any]] = {name: {} for name in given[0].flags}
    for name, per_idx in flags.items():
        for s in given:
            for idx, value in s.flags[name].items():
                if value or idx not in per_idx:  # an initialized row's flag wins over an empty row's
                    per_idx[idx] = value
    return LayerState(tensors=tensors, flags=flags)


def _zeros(template: torch.Tensor, width: int) -> torch.Tensor:
    return template.new_zeros((*template.shape[:-1], width))


def select_row(state: LayerState, row: int) -> LayerState:
    """Clones of batch row `row` of `state` (one row, to store alone)."""
    rows = LayerState(
        tensors={
            name: {i: (t[row : row + 1] if t is not None else None) for i, t in per.items()}
            for name, per in state.tensors.items()
        },
        flags=state.flags,
    )
    return clone_states([rows])[0]


def clone_many(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Clones of `tensors` made by one multi-tensor copy (on CUDA a few launches per device and dtype, not one per
    tensor).

    >>> a, b = torch.ones(2), torch.zeros(3, dtype=torch.int64)
    >>> [t.tolist() for t in clone_many([a, b])], clone_many([a])[0].data_ptr() != a.data_ptr()
    ([[1.0, 1.0], [0, 0, 0]], True)
    """
    out: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    for t in tensors:
        out.append(torch.empty_like(t))
        sources.append(t.detach())
    if out:
        with torch.no_grad():
            torch._foreach_copy_(out, sources)
    return out


def clone_states(states: Sequence[LayerState]) -> list[LayerState]:
    """Copies of `states` whose tensors are all cloned by one `clone_many`."""
    if not states:  # a model without recurrent layers restores through here too
        return []
    flat = [t for s in states for per in s.tensors.values() for t in per.values() if t is not None]
    clones = iter(clone_many(flat))
    return [
        LayerState(
            tensors={
                name: {i: (next(clones) if t is not None else None) for i, t in per.items()}
                for name, per in s.tensors.items()
            },
            flags={name: dict(per) for name, per in s.flags.items()},
        )
        for s in states
    ]


class HybridAdapter(RecurrentAdapter):
    """`LinearAttentionAndFullAttentionLayer`: a recurrent state plus full-attention keys."""

    has_kv = True
    _kv = FullAttentionAdapter()

    def capture_kv(self, layer: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._kv.capture_kv(layer)

    def restore_kv(self, layer: Any, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        self._kv.restore_kv(layer, keys, values, length)


class HybridSlidingAdapter(HybridAdapter):
    """`LinearAttentionAndSlidingWindowAttentionLayer`: a recurrent state plus sliding keys, every position kept."""

    _kv = SlidingWindowAdapter()
    is_croppable = False  # its sliding keys: transformers' crop cuts a recording window back (`SlidingWindowAdapter`)
    needs_prepare = True  # the sliding keys' past recording

    def prepare(self, layer: Any) -> None:
        self._kv.prepare(layer)
