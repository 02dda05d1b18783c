"""The model's linear layers on CPU through oneDNN, the kernel torch's own CPU inference paths use
(`use_onednn_linears`), where it is faster than `F.linear` on this machine.

`nn.Linear` on a float32 CPU tensor calls MKL's sgemm. On the AMD EPYC cores this project is measured on, that
call is 1.7x to 3x slower than oneDNN's matmul at every row count a server sees, worst for the few rows of a
decode step: for SmolLM2's 211 linear layers (513 MiB of float32 weights, 2 threads) one pass takes 31.1 ms for
one row against 18.0 ms through oneDNN with the weights laid out once for it ("prepacked"), 50.0 against 16.1 for
two rows, 45.8 against 18.1 for eight, and 2,042 against 1,051 ms for a 1,500-token prefill; a decode step of 8
rows 82.3 against 44.9 ms, `generate` 47.1 against 33.1 ms a token, the tokens the same
(`benchmarks/bench_cpu_linear.py`, `results/bench_cpu_linear.txt`). On an Intel CPU, MKL's own ground, the gap
may be small or reversed, so ``"auto"`` first times the two kernels on one layer of each of the model's weight
shapes, counted once per layer of that shape, and keeps torch's where oneDNN is not clearly faster.

Kernels (`Kernel`):

* ``prepacked``: oneDNN with a copy of each weight in its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`),
  the fastest; it costs a second copy of every linear weight (513 MiB for SmolLM2 in float32);
* ``onednn``: oneDNN on the weights as they are (no copy; 1.6x to 2x torch's speed where ``prepacked`` is 1.7x to 3.1x);
* ``torch``: `F.linear`, as the model came.

A patched layer runs oneDNN only where its answer is torch's to float tolerance and its weights are the ones it
was patched with: on a float32 CPU input with autograd off (``torch.no_grad``, inference mode), the weight the
same tensor at the same version and address (a weight changed in place, replaced, or given new data after the
patch goes back to `F.linear`, never to a stale packed copy). Every layer is checked against `F.linear` once when
it is patched; one that disagrees leaves the whole model on torch's kernel, with the reason.

Example:
    >>> import torch
    >>> layer = torch.nn.Sequential(torch.nn.Linear(8, 4))
    >>> kernels = use_onednn_linears(layer, "onednn")
    >>> kernels.kernel, kernels.layers
    ('onednn', 1)
    >>> with torch.no_grad():
    ...     x = torch.randn(3, 8)
    ...     torch.allclose(layer(x), torch.nn.functional.linear(x, layer[0].weight, layer[0].bias), atol=1e-5)
    True
    >>> restore_torch_linears(layer)
    1
"""

from __future__ import annotations

import functools
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

#: The kernels a model's linear layers can run on CPU; ``auto`` picks one by timing (`use_onednn_linears`).
Kernel = Literal["prepacked", "onednn", "torch"]
Choice = Literal["auto", "prepacked", "onednn", "torch"]
CHOICES: tuple[Choice, ...] = ("auto", "prepacked", "onednn", "torch")

#: The attribute a patched layer keeps its oneDNN state under.
STATE = "_hf_prefix_cache_onednn"
#: The row count the prepacked layout is chosen for (a decode step's few rows; larger counts run as fast).
PACK_ROWS = 8
#: oneDNN must be at least this much faster than torch on the probe for ``auto`` to choose it.
MIN_GAIN = 1.15
#: ``auto`` prepacks only where the weights' second copy takes at most this share of the memory available.
MAX_PACK_SHARE = 0.25


@dataclass(frozen=True, slots=True)
class LinearKernels:
    """What `use_onednn_linears` did to a model.

    Attributes:
        kernel: the kernel its linear layers now run (``torch``: left as they came).
        layers: how many layers run it.
        extra_bytes: the memory the prepacked copies take (0 unless ``prepacked``).
        reason: why ``torch`` was kept, or how ``auto`` chose (empty where the kernel was asked for by name).
        timings: ``auto``'s probe, milliseconds per kernel: a pass over 1 and 8 rows of every layer (each shape
            timed once, counted once per layer of that shape).
    """

    kernel: Kernel
    layers: int = 0
    extra_bytes: int = 0
    reason: str = ""
    timings: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        """One line for a log.

        >>> LinearKernels("torch", reason="the model is not on CPU").describe()
        'linear layers: torch (the model is not on CPU)'
        """
        text = f"linear layers: {self.kernel}"
        if self.layers:
            text += f", {self.layers} layers"
        if self.extra_bytes:
            text += f", {self.extra_bytes / 2**20:.0f} MiB of prepacked weights"
        return text + (f" ({self.reason})" if self.reason else "")


@dataclass(slots=True)
class _State:
    """A patched layer's oneDNN weight and the weight it was made from (to notice a change)."""

    weight: torch.Tensor
    source: torch.Tensor
    version: int
    address: int  # the source's storage (``param.data = ...`` swaps it without a new version)


def onednn_unavailable() -> str | None:
    """Why torch's oneDNN linear cannot run here, or None where it can."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return "this torch was built without oneDNN (MKL-DNN)"
    try:
        torch.ops.mkldnn._linear_pointwise  # noqa: B018 (a private op: it may leave a later torch)
        torch.ops.mkldnn._reorder_linear_weight  # noqa: B018
    except (AttributeError, RuntimeError) as exc:
        return f"this torch has no oneDNN linear op ({exc})"
    return None


def use_onednn_linears(model: nn.Module, choice: Choice = "auto") -> LinearKernels:
    """Run `model`'s float32 CPU `nn.Linear` layers through oneDNN (`choice`: a kernel, or ``auto`` to time them);
    what it did. Layers of other classes (quantized, LoRA, ...) and models not on CPU in float32 are left as they
    are. Undo with `restore_torch_linears`.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 4)).to(torch.bfloat16)
        >>> use_onednn_linears(model).reason
        'its linear weights are not float32 on CPU'
    """
    if choice not in CHOICES:
        raise ValueError(f"unknown linear kernel {choice!r}: choose one of {', '.join(CHOICES)}")
    restore_torch_linears(model)
    if choice == "torch":
        return LinearKernels("torch", reason="asked for")
    layers = [m for m in model.modules() if type(m) is nn.Linear and _eligible(m.weight)]
    if not layers:
        return LinearKernels("torch", reason="its linear weights are not float32 on CPU")
    missing = onednn_unavailable()
    if missing is not None:
        return LinearKernels("torch", reason=missing)
    reason, timings = "", dict[str, float]()
    if choice == "auto":
        kernel, reason, timings = _choose(layers)
        if kernel == "torch":
            return LinearKernels("torch", reason=reason, timings=timings)
    else:
        kernel = choice
    extra = 0
    for layer in layers:
        weight = layer.weight.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS) if kernel == "prepacked" else weight
        if kernel == "prepacked":
            extra += weight.numel() * weight.element_size()
        setattr(layer, STATE, _State(packed, layer.weight, layer.weight._version, layer.weight.data_ptr()))
        layer.forward = types.MethodType(_forward, layer)  # type: ignore[method-assign]
    mismatch = _check(layers)
    if mismatch is not None:
        restore_torch_linears(model)
        return LinearKernels("torch", reason=mismatch, timings=timings)
    return LinearKernels(kernel, len(layers), extra, reason, timings)


def restore_torch_linears(model: nn.Module) -> int:
    """Put `model`'s patched linear layers back on `F.linear` (their prepacked copies freed); how many."""
    count = 0
    for module in model.modules():
        if hasattr(module, STATE):
            delattr(module, STATE)
            if "forward" in vars(module):
                del module.forward
            count += 1
    return count


def _eligible(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.layout == torch.strided


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    state: _State = getattr(self, STATE)
    if (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and not torch.is_grad_enabled()
        and self.weight is state.source
        and self.weight._version == state.version
        and self.weight.data_ptr() == state.address
    ):
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, state.weight, self.bias, "none", [], "")
        return out
    return F.linear(x, self.weight, self.bias)


def _check(layers: list[nn.Linear]) -> str | None:
    """Each patched layer against `F.linear` on three random rows; why one disagrees, or None."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in layers:
            x = torch.randn(3, layer.in_features, generator=generator)
            got = layer(x)
            want = F.linear(x, layer.weight, layer.bias)
            tolerance = 1e-4 * (1.0 + float(want.abs().max()))
            if got.shape != want.shape or not bool((got - want).abs().max() <= tolerance):
                return f"oneDNN's linear disagreed with torch's on a {tuple(layer.weight.shape)} layer"
    return None


def _choose(layers: list[nn.Linear]) -> tuple[Kernel, str, dict[str, float]]:
    """``auto``: time torch's kernel and oneDNN's on one layer of each weight shape (1 and 8 rows), each shape's time
    counted once per layer of that shape (a pass over the model's linear layers); the faster, and why."""
    shapes: dict[tuple[int, int, bool], list[nn.Linear]] = {}
    for layer in layers:
        shapes.setdefault((*layer.weight.shape, layer.bias is not None), []).append(layer)
    extra = sum(m.weight.numel() * m.weight.element_size() for m in layers)
    available = _available_bytes()
    pack = available is not None and extra <= MAX_PACK_SHARE * available
    fast: Kernel = "prepacked" if pack else "onednn"
    timings: dict[str, float] = {"torch": 0.0, fast: 0.0}
    with torch.no_grad():
        for same in shapes.values():
            weight = same[0].weight.detach()
            bias = None if same[0].bias is None else same[0].bias.detach()
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS) if pack else weight
            inputs = [torch.randn(rows, weight.shape[1]) for rows in (1, PACK_ROWS)]
            timings["torch"] += len(same) * _time(functools.partial(_torch_linear, weight=weight, bias=bias), inputs)
            timings[fast] += len(same) * _time(functools.partial(_onednn_linear, weight=packed, bias=bias), inputs)
    gain = timings["torch"] / max(timings[fast], 1e-9)
    over = f"over its {len(layers)} linear layers ({len(shapes)} shapes)"
    if gain < MIN_GAIN:
        return "torch", f"oneDNN {gain:.2f}x torch's speed {over}: kept torch's", timings
    why = f"oneDNN {gain:.2f}x torch's speed {over}"
    if not pack:
        why += ", not prepacked: its copy would take more than a quarter of the memory available"
    return fast, why, timings


def _torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return out


def _time(run: Callable[[torch.Tensor], Any], inputs: list[torch.Tensor], repeats: int = 5) -> float:
    """The fastest of `repeats` passes of `run` over `inputs`, in milliseconds (after one pass to warm up)."""
    for x in inputs:
        run(x)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for x in inputs:
            run(x)
        best = min(best, time.perf_counter() - start)
    return best * 1000


def _available_bytes() -> int | None:
    """The memory this machine has available (``MemAvailable``), or None where it cannot tell."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
