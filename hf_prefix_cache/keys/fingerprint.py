"""What the namespace reads of a model's weights: a sampled fingerprint, its adapters' state, its dtype's source.

Read when a store is made and when the weights probe (`weights.WeightsProbe`) sees a change, not
on every request.
"""

from __future__ import annotations

import inspect
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


def is_tuner_layer(module: Any) -> bool:
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
        tuners = [m for m in model.modules() if is_tuner_layer(m)]
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


# transformers' `dtype` properties (`PreTrainedModel.dtype` in 5.24, `ModuleUtilsMixin.dtype` in 5.23):
# the dtype of the first floating-point parameter, so it can change only with a parameter, which
# the probe sees.
_DTYPE_FROM_PARAMETERS = {
    ("transformers.modeling_utils", "PreTrainedModel.dtype"),
    ("transformers.modeling_utils", "ModuleUtilsMixin.dtype"),
}


def dtype_from_parameters(model: Any) -> bool:
    """Whether `model.dtype` is transformers' property over the parameters (not an attribute of its own)."""
    found = inspect.getattr_static(type(model), "dtype", None)
    getter = getattr(found, "fget", None)
    return (
        isinstance(found, property)
        and (
            getattr(getter, "__module__", None),
            getattr(getter, "__qualname__", None),
        )
        in _DTYPE_FROM_PARAMETERS
    )
