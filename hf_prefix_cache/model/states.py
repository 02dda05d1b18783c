"""What a working cache's states become when stored, besides key/value runs: state snapshots and media item states.

A `Snapshot` holds the states of every stateful layer after exactly `length` tokens; an
`ItemState` holds what one media item alone computed (Mllama: an image's cross-attention
keys/values); touching window snapshots become one (`merge_windows`). A finished request's
cache hands the store all it keeps as one `Captured` value (`WorkingCache.captured`): its
`Run` of keys/values (`runs.py`), the copy of its new positions and its snapshots. The working
cache makes them, the storage layer keeps them.

Knows nothing about the tree or the store.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from hf_prefix_cache.model.layers import LayerAdapter, LayerState
from hf_prefix_cache.model.runs import Run


@dataclass(slots=True)
class Snapshot:
    """Recurrent states of every stateful layer after exactly `length` tokens.

    A snapshot on disk keeps its length and size but no states (`states` is empty) until its
    segment is loaded back. A snapshot of window states only (sliding layers in window mode) may
    hold extended windows that also restore any length in `[length - reach, length]`.
    """

    length: int
    states: dict[int, LayerState]
    nbytes: int = -1
    reach: int = 0

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            self.nbytes = sum(s.nbytes for s in self.states.values())

    def devices(self) -> dict[int, torch.device]:
        """The device of each layer's states (a layer holding no tensor is left out)."""
        out: dict[int, torch.device] = {}
        for layer, state in self.states.items():
            first = next((t for per in state.tensors.values() for t in per.values() if t is not None), None)
            if first is not None:
                out[layer] = first.device
        return out


@dataclass(slots=True)
class ItemState(Snapshot):
    """The states one media item computed alone (Mllama: an image's cross-attention keys/values).

    `length` is the end of the item's placeholder span: a restored prefix that holds the span
    restores the state with it. Stored, moved and written like a snapshot, but it never
    restores a prefix by itself.
    """


def state_tensors(snapshots: Iterable[Snapshot]) -> list[torch.Tensor]:
    """Every tensor held by `snapshots` (recurrent snapshots or item states)."""
    out: list[torch.Tensor] = []
    for snap in snapshots:
        for state in snap.states.values():
            for per_idx in state.tensors.values():
                for t in per_idx.values():
                    if t is not None:
                        out.append(t)
    return out


def merge_windows(snapshots: Sequence[Snapshot], adapters: Sequence[LayerAdapter]) -> list[Snapshot]:
    """Window-only snapshots whose windows touch become one extended snapshot (fewer bytes than two).

    Only for models whose every state layer is a window (sliding layers in window mode, each
    extended by its adapter, `adapters[layer]`): the merged snapshot sits at the later length and
    restores any length back to the earlier one.
    """
    out: list[Snapshot] = []
    for snap in sorted(snapshots, key=lambda s: s.length):
        if out and snap.length > out[-1].length:
            merged = _extend(out[-1], snap, adapters)
            if merged is not None:
                out[-1] = merged
                continue
        out.append(snap)
    return out


def _extend(earlier: Snapshot, later: Snapshot, adapters: Sequence[LayerAdapter]) -> Snapshot | None:
    states = {}
    for i, state in later.states.items():
        extended = adapters[i].extend(earlier.states[i], state)
        if extended is None:
            return None
        states[i] = extended
    return Snapshot(later.length, states, reach=later.length - earlier.length + earlier.reach)


class Captured(NamedTuple):
    """What a finished request's working cache hands the store, every new value checked finite.

    `run` holds the keys/values of positions `[0, length)` by reference (None: no layer has keys),
    with `nbytes_per_token` bytes per position; `tail`, when the request restored a prefix, is a
    packed copy of the positions it computed; `snapshots` are its state snapshots, windows that
    touch merged.
    """

    run: Run | None
    tail: Run | None
    snapshots: list[Snapshot]
    nbytes_per_token: int
