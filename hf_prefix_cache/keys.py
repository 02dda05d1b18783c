"""PrefixKey and namespaces: what identifies reusable work.

A key is a namespace plus the token ids of a sequence. The namespace covers what changes the
meaning of cached states for the same tokens: the model class and config, its weights (a
fingerprint sampled from every parameter, so two fine-tunes of one config never share, which
matters most for entries persisted on disk), its dtype, active adapters and an optional user
salt that keeps tenants apart. Entries of different
namespaces never share tree nodes. Token ids are compared one by one on every hit, so no
hash is ever trusted alone; the 128-bit xxhash here only fingerprints configurations.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

# Elements read from each parameter for the weights fingerprint: evenly spaced, so a fine-tune
# (which moves nearly every element) or a merged adapter (a dense low-rank update) changes it.
_SAMPLES_PER_PARAMETER = 4096


@dataclass(frozen=True, slots=True)
class PrefixKey:
    """A sequence's identity in the store."""

    namespace: str
    tokens: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.tokens)


def fingerprint(obj: Any) -> str:
    """128-bit xxhash of a JSON-serialisable object, as 32 hex digits."""
    blob = json.dumps(obj, sort_keys=True, default=str).encode()
    return xxhash.xxh3_128_hexdigest(blob)


def sample_indices(numel: int, count: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """`count` evenly spaced int64 indices into `numel` elements, first and last included.

    Integer arithmetic throughout: a float32 `linspace` cannot hold every integer past 2**24, so
    its last index rounded past the end of any parameter over 16.7M elements (a 7B embedding).

    >>> sample_indices(2**24 + 3, 3).tolist()
    [0, 8388609, 16777218]
    """
    if numel <= count:
        return torch.arange(numel, dtype=torch.int64, device=device)
    steps = torch.arange(count, dtype=torch.int64, device=device)
    return steps * (numel - 1) // (count - 1)


def weights_fingerprint(model: Any) -> str:
    """128-bit fingerprint of a model's weights: names, dtypes, shapes and a sample of every parameter.

    Reads at most a few thousand elements per parameter, gathered on the parameter's own device,
    so it costs milliseconds even for large models.
    """
    h = xxhash.xxh3_128()
    h.update(str(getattr(model, "name_or_path", "")).encode())
    with torch.no_grad():
        for name, param in model.named_parameters():
            flat = param.detach().reshape(-1)
            h.update(f"{name}:{flat.dtype}:{tuple(param.shape)}".encode())
            if flat.numel() > _SAMPLES_PER_PARAMETER:
                flat = flat[sample_indices(flat.numel(), _SAMPLES_PER_PARAMETER, flat.device)]
            if flat.numel() and flat.device.type != "meta":
                h.update(flat.to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


# Bumped whenever any module anywhere registers a parameter or a submodule (`module.weight =
# nn.Parameter(...)`, adding an adapter), so a cached parameter list is re-read only then.
_structure_epoch = 0


_seen_modules: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _parameter_registered(*args: Any) -> None:
    global _structure_epoch
    _structure_epoch += 1


def _module_registered(parent: Any, name: str, module: Any) -> None:
    # Models slice their layer lists on every forward (`layers[:n]` registers the same layers in a
    # new ModuleList); only a module never registered before can bring new parameters.
    global _structure_epoch
    if module is not None and module not in _seen_modules:
        _seen_modules.add(module)
        _structure_epoch += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_parameter_registered)
torch.nn.modules.module.register_module_module_registration_hook(_module_registered)


class WeightsProbe:
    """A cheap token that changes whenever a model's parameters are replaced, added or modified in place.

    Every in-place write to a tensor (an optimizer step, `load_state_dict`, merging an adapter)
    bumps its `_version`; registering a parameter or a module (replacing a weight, adding an
    adapter) bumps a process-wide epoch, after which the parameter list is read again. A check
    costs a few microseconds, so the store runs it on every request and recomputes the weights
    fingerprint only when it changed. Not seen: `param.data = other` (no version bump); call
    `store.clear()` after swapping weights that way.
    """

    def __init__(self, model: Any) -> None:
        self._model = model
        self._epoch = -1
        self._params: list[Any] = []
        self._ids = 0

    def version(self) -> int:
        if self._epoch != _structure_epoch:
            self._epoch = _structure_epoch
            self._params = list(self._model.parameters())
            self._ids = hash(tuple(id(p) for p in self._params))
        # Versions only grow, so over one parameter list their sum changes whenever one of them does.
        return hash((self._ids, sum(p._version for p in self._params)))


def adapter_state(model: Any) -> tuple[tuple[str, ...], bool] | None:
    """Active adapter names and whether adapters are switched off (`disable_adapters`), or None."""
    if not getattr(model, "peft_config", None):
        return None
    try:
        active = tuple(model.active_adapters())
    except (AttributeError, ValueError):
        active = tuple(sorted(model.peft_config))
    disabled = False
    for module in model.modules():
        if hasattr(module, "_disable_adapters"):
            disabled = bool(module._disable_adapters)
            break
    return active, disabled


def model_namespace(model: Any, salt: str | None = None, weights: str | None = None) -> str:
    """The namespace of `model` as it is now (dtype and adapters can change between calls).

    `weights` is the model's `weights_fingerprint`, computed by the store when it changes.
    """
    config = model.config.to_dict() if hasattr(model.config, "to_dict") else {}
    parts = {
        "class": type(model).__name__,
        "config": fingerprint(config),
        "weights": weights,
        "dtype": str(getattr(model, "dtype", None)),
        "adapters": adapter_state(model),
        "salt": salt,
    }
    return fingerprint(parts)
