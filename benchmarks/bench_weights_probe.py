"""Cost of the per-request weights check (`WeightsProbe.check`) on real-size models.

Every request through a store runs `WeightsProbe.check` (see `hf_prefix_cache/keys/weights.py`):
it re-reads every module's parameter dict (compared by identity) and the `_version`s on the host
(data pointers and layouts only after a `.data` assignment or `swap_tensors`), and compares
a sample of 8 elements bitwise only for the parameters an unversioned alias (`.data`, NumPy,
DLPack) was taken of since the last check or is still alive (none, in this benchmark's loop). When that sees a
change, the store recomputes the full weights fingerprint (`weights_fingerprint`, 4,096
elements per parameter) once.

Models (random weights, bfloat16 unless `--dtype`), built on the meta device then allocated
for real with `to_empty` and filled with `normal_`:

* ``smollm2``: the real SmolLM2-135M-Instruct (`hf_prefix_cache.load_smollm2`), float32.
* ``1b``: Llama-3.2-1B shape (16 layers, hidden 2048, vocab 128,256, tied embeddings).
* ``7b``: Llama-2-7B shape (32 layers, hidden 4096, vocab 32,000): needs ~13.5 GB.

Printed per model, medians over `--reps` calls side by side: ``check`` (no change, the
per-request cost), ``fingerprint`` (the recompute after a change) and ``decode`` (one
forward of one token with an empty cache, for scale), and whether `p.data.add_(1)` on the
output projection was seen.

Run: ``PYTHONPATH=. python benchmarks/bench_weights_probe.py --models smollm2,1b`` (CPU) or
``--device cuda --models 1b,7b``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from _common import print_end, print_environment, start_run
from transformers import LlamaConfig, LlamaForCausalLM

from hf_prefix_cache.keys.weights import WeightsProbe, weights_fingerprint

SHAPES: dict[str, dict[str, Any]] = {
    "1b": {
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
    },
    "7b": {
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "tie_word_embeddings": False,
    },
}


def build(name: str, device: str, dtype: torch.dtype) -> Any:
    if name == "smollm2":
        from hf_prefix_cache.api.models import load_smollm2

        model, _ = load_smollm2()
        return model.to(device).eval()
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[name]))
    model = model.to_empty(device=device).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
        for b in model.buffers():  # rotary frequencies: any finite values do for timing
            b.uniform_(0, 1)
    return model


def median_seconds(fn: Any, reps: int, sync: bool) -> float:
    samples = []
    for _ in range(reps):
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="smollm2,1b")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    started = start_run(args.threads)
    print_environment(f", device {args.device}")
    sync = args.device.startswith("cuda")
    dtype = getattr(torch, args.dtype)
    print(
        f"{'model':>8} {'params':>7} {'tensors':>7} {'check ms':>9} {'fingerprint ms':>15} {'decode ms':>10} "
        f"{'check/decode':>12}  data.add_ seen"
    )
    for name in args.models.split(","):
        model = build(name, args.device, dtype)
        num_params = sum(p.numel() for p in model.parameters())
        num_tensors = len(list(model.parameters()))
        probe = WeightsProbe(model)
        probe.check()
        check = median_seconds(probe.check, args.reps, sync)
        fingerprint = median_seconds(lambda m=model: weights_fingerprint(m), max(3, args.reps // 10), sync)
        ids = torch.tensor([[1, 2, 3, 4]], device=args.device)

        def decode(m: Any = model, one: torch.Tensor = ids[:, :1]) -> None:
            with torch.no_grad():
                m(input_ids=one, use_cache=False, logits_to_keep=1)

        decode()
        forward = median_seconds(decode, max(3, args.reps // 5), sync)
        before = probe.check()
        model.lm_head.weight.data.add_(1)
        seen = probe.check() != before
        print(
            f"{name:>8} {num_params / 1e9:>6.2f}B {num_tensors:>7} {check * 1e3:>9.3f} {fingerprint * 1e3:>15.2f} "
            f"{forward * 1e3:>10.2f} {check / forward:>12.3f}  {seen}"
        )
        del model, probe
        if sync:
            torch.cuda.empty_cache()
    print_end(started)


if __name__ == "__main__":
    main()
