"""On a CUDA GPU: time to first token cold vs hit vs ideal at Llama-3.2-1B shape, and tier copy speeds.

Model: a random-weight `LlamaForCausalLM` at Llama-3.2-1B's published shape (16 layers, hidden
2048, 32 heads, 8 KV heads, intermediate 8192, vocab 128256), bfloat16, on `cuda:0`. Random
weights make no sense of the text, but the work per token is that of the real model.

For each prompt length: `cold` is `generate(prompt, max_new_tokens=1)`; `hit` is the same call
through a store holding the prompt minus its last 32 tokens (every repetition uses new last
tokens); `ideal` hands generate a `DynamicCache` already holding those tokens (views of one
prefix forward). Times are medians after warm-up with `torch.cuda.synchronize()` around each
call. Then the store's tiers: a prefix of the longest length is pushed to pinned host memory
and brought back, and GB/s are printed for both directions.

Run on a GPU machine: ``python benchmarks/bench_cuda.py`` (``--quick`` for short prompts).
Exits with a message when no CUDA device is present.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
import transformers
from _common import CACHE
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hf_prefix_cache import PrefixCache


def build_llama_1b() -> Any:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=True,
        eos_token_id=None,
        pad_token_id=None,
    )
    with torch.device("cuda"):
        model: Any = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


def timed(fn: Any, *args: Any, **kwargs: Any) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn(*args, **kwargs)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def first_token(model: Any, ids: torch.Tensor, cache: Any = None) -> float:
    """Seconds to the first new token of `ids` (`max_new_tokens=1`), optionally with a cache."""
    extra = {} if cache is None else {CACHE: cache}
    return timed(model.generate, ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, **extra)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_cuda needs a CUDA device; none is available here")
    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    lengths = [512, 2048] if args.quick else [512, 2048, 4096, 8192, 32768]
    model = build_llama_1b()
    print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; transformers {transformers.__version__}")
    print("model: Llama-3.2-1B shape, random weights, bfloat16\n")
    print(f"{'prompt':>7s} {'cold ms':>9s} {'hit ms':>8s} {'ideal ms':>9s} {'cold/hit':>9s} {'hit/ideal':>10s}")
    gen = torch.Generator().manual_seed(0)
    tail = 32
    for n in lengths:
        prefix = torch.randint(10, 128000, (1, n - tail), generator=gen).cuda()
        store = PrefixCache(model)
        with torch.no_grad():
            out = model(prefix, use_cache=True)
        kv = out.past_key_values
        model.generate(prefix, attention_mask=torch.ones_like(prefix), max_new_tokens=1, **{CACHE: store})
        cold, hit, ideal = [], [], []
        for rep in range(args.reps + 1):
            suffix = torch.randint(10, 128000, (1, tail), generator=gen).cuda()
            suffix[0, 0] = 5 + rep  # a new first token each time: the match is exactly the prefix
            ids = torch.cat([prefix, suffix], 1)
            t_cold = first_token(model, ids)
            t_hit = first_token(model, ids, store)
            ready = DynamicCache()
            for i, layer in enumerate(kv.layers):
                ready.update(layer.keys[..., : n - tail, :], layer.values[..., : n - tail, :], i)
            t_ideal = first_token(model, ids, ready)
            if rep:  # the first round warms kernels up
                cold.append(t_cold)
                hit.append(t_hit)
                ideal.append(t_ideal)
        c, h, i = (statistics.median(x) * 1e3 for x in (cold, hit, ideal))
        print(f"{n:7d} {c:9.2f} {h:8.2f} {i:9.2f} {c / h:8.1f}x {h / i:10.3f}")
        store.detach()
        del kv, out
        torch.cuda.empty_cache()

    n = lengths[-1]
    prefix = torch.randint(10, 128000, (1, n), generator=gen).cuda()
    store = PrefixCache(model, max_host_bytes="64GB")
    model.generate(prefix, attention_mask=torch.ones_like(prefix), max_new_tokens=1, **{CACHE: store})
    nbytes = store.stats().device_nbytes
    t_down = timed(setattr, store, "max_bytes", 0)
    assert store.stats().host_nbytes == nbytes
    store.max_bytes = 2 * nbytes
    t_up = timed(lambda: store.lookup(prefix[0].tolist()).release())
    print(f"\ntiers: {nbytes / 1e6:.1f} MB entry; device->pinned host {nbytes / t_down / 1e9:.2f} GB/s")
    print(f"       pinned host->device on a hit {nbytes / t_up / 1e9:.2f} GB/s (incl. match and restore)")
    store.detach()


if __name__ == "__main__":
    main()
