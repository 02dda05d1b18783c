"""How stored states become safetensors tensors plus JSON metadata, and back: shared by the disk and remote tiers.

A file or chunk holds each layer's keys and values as tensors ``k.<layer>`` and ``v.<layer>``,
and snapshots and item states as tensors named ``<prefix>.<length>.<layer>.<attr>.<index>`` with
their layout in JSON (`encode`; read back by `decode`); `checksum` covers the metadata and every
tensor, so a file or a server value that was changed or truncated is refused (`verified`,
`CorruptFileError`). Nothing is ever unpickled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import xxhash

from hf_prefix_cache.model.layers import LayerState
from hf_prefix_cache.model.states import ItemState, Snapshot
from hf_prefix_cache.storage.segments import Segment

S = TypeVar("S", bound=Snapshot)


class CorruptFileError(Exception):
    """A segment file is unreadable, truncated, fails its checksum or does not fit the model."""


@dataclass(frozen=True, slots=True)
class Layout:
    """What a file must look like to fit the model: layer count and which layers have keys, states or item states."""

    num_layers: int
    kv_layers: tuple[int, ...]
    state_layers: tuple[int, ...]
    item_layers: tuple[int, ...] = ()


def encode(
    keys: Sequence[torch.Tensor | None],
    values: Sequence[torch.Tensor | None],
    snapshots: Mapping[int, Snapshot],
    items: Mapping[int, ItemState],
    meta: dict[str, Any],
) -> dict[str, torch.Tensor]:
    """The tensors of a file or chunk: each layer's keys and values (on the CPU), then `snapshots` and `items`.

    `meta` (the file's or chunk's own fields) gains the layout of the states and, last, the
    checksum that covers it all.
    """
    tensors: dict[str, torch.Tensor] = {}
    for i, (k, v) in enumerate(zip(keys, values, strict=True)):
        if k is not None and v is not None:
            tensors[f"k.{i}"] = k.detach().to("cpu").contiguous()
            tensors[f"v.{i}"] = v.detach().to("cpu").contiguous()
    meta["snapshots"] = states_to_file("s", snapshots, tensors)
    meta["items"] = states_to_file("i", items, tensors)
    meta["checksum"] = checksum(tensors, meta)
    return tensors


def verified(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> bool:
    """Whether `meta`'s checksum is that of `tensors` and the rest of `meta`: nothing changed since `encode`."""
    return bool(meta.get("checksum") == checksum(tensors, {k: v for k, v in meta.items() if k != "checksum"}))


def decode(
    tensors: dict[str, torch.Tensor], meta: dict[str, Any], layout: Layout, stub: Segment
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None], dict[int, Snapshot], dict[int, ItemState]]:
    """Each layer's keys and values (None for layers without), and the snapshots and item states of `stub`'s range.

    Raises:
        CorruptFileError: keys, states or item states for other layers than `layout`'s.
    """
    assert stub.disk is not None
    keys: list[torch.Tensor | None] = [tensors.get(f"k.{i}") for i in range(layout.num_layers)]
    values: list[torch.Tensor | None] = [tensors.get(f"v.{i}") for i in range(layout.num_layers)]
    if [i for i, k in enumerate(keys) if k is not None] != list(layout.kv_layers):
        raise CorruptFileError(f"{stub.disk.path} has keys for other layers than the model's {layout.kv_layers}")
    snapshots = states_from_file("s", meta.get("snapshots", {}), tensors, stub, layout.state_layers, Snapshot)
    items = states_from_file("i", meta.get("items", {}), tensors, stub, layout.item_layers, ItemState)
    return keys, values, snapshots, items


def states_to_file(prefix: str, at: Mapping[int, Snapshot], tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """JSON metadata for snapshots (or item states) `at`; their tensors go into `tensors` as `<prefix>.<n>.…`."""
    out: dict[str, Any] = {}
    for length, snap in at.items():
        layers: dict[str, Any] = {}
        for layer, state in snap.states.items():
            # attribute -> {index: whether a tensor is stored for it} (a layer may hold None at an index)
            present: dict[str, dict[str, bool]] = {}
            for attr, per_idx in state.tensors.items():
                present[attr] = {str(idx): t is not None for idx, t in per_idx.items()}
                for idx, t in per_idx.items():
                    if t is not None:
                        tensors[f"{prefix}.{length}.{layer}.{attr}.{idx}"] = t.detach().to("cpu").contiguous()
            layers[str(layer)] = {"tensors": present, "flags": flags_to_json(state.flags)}
        out[str(length)] = {"nbytes": snap.nbytes, "layers": layers, "reach": snap.reach}
    return out


def states_from_file(
    prefix: str,
    meta: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    stub: Segment,
    layers: tuple[int, ...],
    kind: type[S],
) -> dict[int, S]:
    """The snapshots (or item states) of `meta` that fall in `stub`'s range, checked to cover exactly `layers`."""
    assert stub.disk is not None
    out: dict[int, S] = {}
    for length_text, snap_meta in meta.items():
        length = int(length_text)
        if not stub.start < length <= stub.end:
            continue  # belongs to the other part of a split segment
        states = {}
        for layer_text, layer_meta in snap_meta["layers"].items():
            layer = int(layer_text)
            per_attr: dict[str, dict[int, torch.Tensor | None]] = {}
            for attr, present in layer_meta["tensors"].items():
                per_attr[attr] = {
                    int(i): (tensors[f"{prefix}.{length}.{layer}.{attr}.{i}"] if stored else None)
                    for i, stored in present.items()
                }
            states[layer] = LayerState(tensors=per_attr, flags=flags_from_json(layer_meta["flags"]))
        if sorted(states) != list(layers):
            raise CorruptFileError(f"{stub.disk.path} has states for other layers than the model's {layers}")
        out[length] = kind(length, states, reach=int(snap_meta.get("reach", 0)))
    return out


def checksum(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> str:
    """xxh3-128 over the metadata (symbols, range, layout) and every tensor's name, dtype, shape and bytes."""
    h = xxhash.xxh3_128()
    h.update(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(repr(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def stored_devices(meta: dict[str, Any], num_layers: int) -> list[str | None]:
    devices = list(meta.get("devices") or [])
    if len(devices) != num_layers:
        return [None] * num_layers
    available = {"cpu"} | {f"cuda:{i}" for i in range(torch.cuda.device_count())}
    return [d if d in available else None for d in devices]


def flags_to_json(flags: dict[str, dict[int, Any]]) -> dict[str, dict[str, Any]]:
    return {name: {str(i): value for i, value in per_idx.items()} for name, per_idx in flags.items()}


def flags_from_json(flags: dict[str, dict[str, Any]]) -> dict[str, dict[int, Any]]:
    return {name: {int(i): value for i, value in per_idx.items()} for name, per_idx in flags.items()}
