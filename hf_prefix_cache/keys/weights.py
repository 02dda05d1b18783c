"""The model's weights as the store sees them: a sampled fingerprint, and a per-request probe of changes.

`weights_fingerprint` and `adapter_state` feed the namespace (`namespace.py`); `WeightsProbe`
tells the store when to compute them again.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import xxhash

# Elements read from each parameter for the weights fingerprint: evenly spaced, so a fine-tune
# (which moves nearly every element) or a merged adapter (a dense low-rank update) changes it.
_SAMPLES_PER_PARAMETER = 4096


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
    # new ModuleList); only a module never registered before, or one replacing another (PEFT's
    # `unload` puts the base layer back in place of its LoRA wrapper), changes the structure.
    global _structure_epoch
    replaced = getattr(parent, "_modules", {}).get(name)
    if module is not None and module not in _seen_modules:
        _seen_modules.add(module)
        _structure_epoch += 1
    elif replaced is not None and replaced is not module:
        _structure_epoch += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_parameter_registered)
torch.nn.modules.module.register_module_module_registration_hook(_module_registered)


# Elements the per-request probe reads from each parameter: enough that an edit of a whole
# tensor (`p.data.add_(1)`, `p.data.mul_(1.5)`) shows, few enough to cost microseconds.
_PROBE_SAMPLES = 8


class WeightsProbe:
    """A cheap per-request check that a model's weights and adapters are still those it saw last.

    Each `check` notices, and counts as a change:

    * parameters added, removed or replaced, including by a direct `module._parameters[name] = p`
      (accelerate's `load_checkpoint_and_dispatch` after `init_empty_weights`);
    * a parameter's storage replaced (`p.data = other`, `model.to_empty()`, a dtype or device move);
    * in-place writes that bump a parameter's `_version` (optimizer steps, `load_state_dict`);
    * in-place writes that bypass it (`p.data.add_(1)`, PEFT's `merge_adapter`): a sample of
      `_PROBE_SAMPLES` elements of every parameter, gathered and compared bitwise on its own
      device, one comparison (and synchronisation) per device and dtype;
    * PEFT tuner layers switching their active, merged or disabled adapters.

    Not seen: an in-place write through `.data` that leaves every sampled element as it was
    (one row of an embedding, say). Call `PrefixCache.invalidate()` after such an edit.

    Example:
        >>> probe = WeightsProbe(model)
        >>> before = probe.check()
        >>> _ = model.lm_head.weight.data.add_(1)
        >>> probe.check() > before
        True
    """

    def __init__(self, model: Any) -> None:
        self._model = model
        self._epoch = -1
        self._modules: list[torch.nn.Module] = []
        self._tuners: list[Any] = []
        self._token: tuple[Any, ...] | None = None
        self._indices: list[torch.Tensor | None] = []
        self._reference: list[tuple[list[int], torch.Tensor]] = []
        self.changes = 0
        self.adapters: tuple[Any, ...] | None = None  # `adapter_state` as of the last check

    def check(self) -> int:
        """The number of changes seen so far (it grows by one whenever this check finds one)."""
        if self._epoch != _structure_epoch:
            self._epoch = _structure_epoch
            self._modules = list(self._model.modules())
            self._tuners = [m for m in self._modules if _is_tuner_layer(m)]
        params = [p for m in self._modules for p in m._parameters.values() if p is not None]
        token = (
            tuple(map(id, params)),
            tuple(p.data_ptr() for p in params),
            sum(p._version for p in params),
            adapter_state(self._model, self._tuners),
        )
        self.adapters = token[3]
        if token != self._token:
            self._token = token
            self._indices = [
                None if p.device.type == "meta" else sample_indices(p.numel(), _PROBE_SAMPLES, p.device) for p in params
            ]
            self._reference = self._sample(params)
            self.changes += 1
            return self.changes
        current = self._sample(params)
        if any(not torch.equal(a, b) for (_, a), (_, b) in zip(current, self._reference, strict=True)):
            self._reference = current
            self.changes += 1
        return self.changes

    def _sample(self, params: Sequence[torch.Tensor]) -> list[tuple[list[int], torch.Tensor]]:
        """Sampled elements per (device, dtype) group, as raw bytes so NaN and -0.0 compare bitwise."""
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, (p, idx) in enumerate(zip(params, self._indices, strict=True)):
            if idx is not None and p.numel():
                groups.setdefault((p.device, p.dtype), []).append(i)
        out = []
        with torch.no_grad():
            for members in groups.values():
                picked = [torch.take(params[i].detach(), self._indices[i]) for i in members]  # type: ignore[arg-type]
                out.append((members, torch.cat(picked).view(torch.uint8)))
        return out


def _is_tuner_layer(module: Any) -> bool:
    """A PEFT tuner layer (LoRA, IA3, ...), recognised without importing peft."""
    return (
        hasattr(module, "merged_adapters")
        and hasattr(module, "_active_adapter")
        and hasattr(module, "_disable_adapters")
    )


def adapter_state(model: Any, tuners: list[Any] | None = None) -> tuple[Any, ...] | None:
    """What the PEFT adapters of `model` do now, or None without any.

    Read from the tuner layers themselves (active, merged and disabled adapters), so it is the
    same whether the store wraps the `PeftModel` or the model inside it, and whether adapters
    came from `get_peft_model` or transformers' `add_adapter`.
    """
    if tuners is None:
        tuners = [m for m in model.modules() if _is_tuner_layer(m)]
    if not tuners:
        return None
    states = set()
    for layer in tuners:
        active = layer.active_adapters
        states.add(
            (
                tuple(sorted(active)) if isinstance(active, list | tuple) else (str(active),),
                tuple(sorted(layer.merged_adapters)),
                bool(layer._disable_adapters),
            )
        )
    return tuple(sorted(states))
