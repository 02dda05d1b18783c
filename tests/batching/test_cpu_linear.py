"""Linear layers through oneDNN on CPU (`batching.cpu_linear`): the same answers, and torch's kernel wherever
oneDNN's could be wrong.

A model whose linear layers run oneDNN (prepacked or not) decodes the same greedy tokens as the model as it came,
alone and in the running batch, its logits within the suite's tolerance; a weight changed in place or replaced
after the patch, autograd, or a layer whose oneDNN answer disagrees with `F.linear` all run torch's kernel.
"""

from __future__ import annotations

import pytest
import torch
from conftest import LOGIT_TOL, build, random_prompt
from test_exactness import alone
from torch.nn import functional as F  # noqa: N812

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.batching import cpu_linear
from hf_prefix_cache.batching.batch import RunningBatch
from hf_prefix_cache.batching.cpu_linear import STATE, restore_torch_linears, use_onednn_linears
from hf_prefix_cache.batching.rows import Request, Row

pytestmark = pytest.mark.skipif(cpu_linear.onednn_unavailable() is not None, reason="no oneDNN in this torch")


@pytest.mark.parametrize("kernel", ["prepacked", "onednn"])
def test_onednn_layers_decode_the_same_tokens_alone_and_in_the_batch(kernel: str) -> None:
    """`generate` and the running batch (3 rows through a store) on oneDNN layers equal `generate` on torch's:
    tokens equal, every step's logits within LOGIT_TOL."""
    model = build("llama")
    prompts = [random_prompt(n, seed=seed)[0].tolist() for n, seed in ((30, 1), (22, 2), (41, 3))]
    with torch.no_grad():
        cold = [alone(model, prompt, 8) for prompt in prompts]
        kernels = use_onednn_linears(model, kernel)  # type: ignore[arg-type]
        assert kernels.kernel == kernel and kernels.layers == sum(type(m) is torch.nn.Linear for m in model.modules())
        assert (kernels.extra_bytes > 0) == (kernel == "prepacked")
        fast = alone(model, prompts[0], 8)
        batch = RunningBatch(PrefixCache(model))
        rows = [Row(Request(prompt, max_new_tokens=8, keep_logits=True)) for prompt in prompts]
        for row in rows:
            assert batch.admit(row)
        while batch.rows:
            batch.step()
    assert torch.equal(fast.sequences, cold[0].sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(fast.logits, cold[0].logits, strict=True)) < LOGIT_TOL
    for row, want in zip(rows, cold, strict=True):
        assert row.tokens == want.sequences[0, -8:].tolist()
        diff = max(float((a - b[0]).abs().max()) for a, b in zip(row.logits, want.logits, strict=True))
        assert diff < LOGIT_TOL


def test_a_weight_changed_or_replaced_after_the_patch_runs_torchs_kernel() -> None:
    """No stale prepacked copy: a weight changed in place, a new weight, or new data is used as it is now."""
    layer = torch.nn.Linear(16, 8)
    model = torch.nn.Sequential(layer)
    use_onednn_linears(model, "prepacked")
    x = torch.randn(4, 16)
    with torch.no_grad():
        layer.weight.mul_(2.0)
        assert torch.equal(model(x), F.linear(x, layer.weight, layer.bias))
        layer.weight = torch.nn.Parameter(torch.randn(8, 16))
        assert torch.equal(model(x), F.linear(x, layer.weight, layer.bias))
    other = torch.nn.Linear(16, 8)
    use_onednn_linears(torch.nn.Sequential(other), "prepacked")
    with torch.no_grad():
        other.weight.data = torch.randn(8, 16)  # new storage, the version unchanged
        assert torch.equal(other(x), F.linear(x, other.weight, other.bias))


def test_autograd_runs_torchs_kernel() -> None:
    """With autograd on, the layer is `F.linear` (gradients flow to its weight)."""
    layer = torch.nn.Linear(16, 8)
    use_onednn_linears(torch.nn.Sequential(layer), "prepacked")
    x = torch.randn(4, 16)
    out = layer(x)
    assert torch.equal(out, F.linear(x, layer.weight, layer.bias))
    out.sum().backward()
    assert layer.weight.grad is not None and bool(layer.weight.grad.abs().sum() > 0)


def test_a_layer_that_disagrees_with_torch_leaves_the_whole_model_on_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer is checked against `F.linear` when patched: one wrong answer puts every layer back, with why."""

    def off_by_one(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + (1.0 if self.out_features == 8 else 0.0)

    monkeypatch.setattr(cpu_linear, "_forward", off_by_one)
    model = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Linear(12, 8))
    kernels = use_onednn_linears(model, "onednn")
    assert kernels.kernel == "torch" and kernels.layers == 0
    assert kernels.reason == "oneDNN's linear disagreed with torch's on a (8, 12) layer"
    assert not any(hasattr(m, STATE) or "forward" in vars(m) for m in model.modules())


def test_auto_times_both_kernels_and_says_why() -> None:
    """``auto`` times torch's kernel and oneDNN's on each weight shape, counted per layer, and reports the figures
    and its choice."""
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 1024) for _ in range(3)), torch.nn.Linear(1024, 256))
    kernels = use_onednn_linears(model, "auto")
    assert "torch" in kernels.timings and len(kernels.timings) == 2 and all(t > 0 for t in kernels.timings.values())
    assert kernels.kernel in ("prepacked", "onednn", "torch")
    assert "over its 4 linear layers (2 shapes)" in kernels.reason
    assert kernels.layers == (0 if kernels.kernel == "torch" else 4)


def test_models_not_float32_on_cpu_and_asking_for_torch_leave_the_layers_alone() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 4)).to(torch.bfloat16)
    assert use_onednn_linears(model).reason == "its linear weights are not float32 on CPU"
    plain = torch.nn.Sequential(torch.nn.Linear(8, 4))
    assert use_onednn_linears(plain, "torch").kernel == "torch"
    for m in (*model.modules(), *plain.modules()):
        assert not hasattr(m, STATE) and "forward" not in vars(m)
    with pytest.raises(ValueError, match="unknown linear kernel 'mkl': choose one of auto, prepacked, onednn, torch"):
        use_onednn_linears(plain, "mkl")  # type: ignore[arg-type]


def test_restoring_puts_torchs_kernel_back() -> None:
    layer = torch.nn.Linear(8, 4)
    model = torch.nn.Sequential(layer)
    use_onednn_linears(model, "prepacked")
    assert restore_torch_linears(model) == 1
    assert not hasattr(layer, STATE) and "forward" not in vars(layer)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(model(x), F.linear(x, layer.weight, layer.bias))
