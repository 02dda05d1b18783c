"""On a CUDA GPU: time to first token cold vs hit vs ideal at Llama-3.2-1B shape, and tier copy speeds.

Model: a random-weight `LlamaForCausalLM` at Llama-3.2-1B's published shape (16 layers, hidden
2048, 32 heads, 8 KV heads, intermediate 8192, vocab 128256), bfloat16, on `cuda:0`. Random
weights make no sense of the text, but the work per token is that of the real model.

For each prompt length: `cold` is `generate(prompt, max_new_tokens=1)`; `hit` is the same call
through a store holding the prompt minus its last 32 tokens (every repetition uses new last
tokens); `ideal` hands generate a `DynamicCache` already holding those tokens (views of one
prefix forward). Times are medians after warm-up with `torch.cuda.synchronize()` around each
call; `store ms` is hit minus ideal, the store's whole share (keying, restore, storing), and
`hit/ideal` the median of each repetition's own ratio.

Then the host tier, against the card's own copy speed: `raw` copies one buffer of the entry's
size between the device and a page-locked host buffer; `store` moves the entry down
(`max_bytes = 0`) and brings it back on a lookup (match, copy and restore). The first round
allocates the page-locked pool; the steady figure is the median of later rounds, which reuse it.

Last, a hit whose prefix waits in host memory: `overlapped` is the shipped path (each layer's
copy lands on a side stream while earlier layers compute: `model/landing.py`), `copy first`
lands every copy before the prefill (the path of models that cannot restore by layer), and
`on device` is the same hit once the entry is back on the device.

Run on a GPU machine: ``python benchmarks/bench_cuda.py`` (``--quick`` for short prompts,
``--profile`` for the store's hottest functions on a hit). ``--device cpu --small`` runs the same
steps on a small model on the CPU, to check the script without a GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import transformers
from _common import CACHE, hub_kernels
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.model.working_cache import WorkingCache

TAIL = 32  # new tokens after the stored prefix on every hit


def build_llama(device: str, small: bool) -> Any:
    """Llama-3.2-1B's shape in bfloat16 (or a 4-layer float32 model of width 256 with `small`)."""
    torch.manual_seed(0)
    sizes = (1000, 256, 512, 4, 8) if small else (128256, 2048, 8192, 16, 64)
    names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim")
    shape: dict[str, Any] = dict(zip(names, sizes, strict=True))
    config = LlamaConfig(
        **shape,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=True,
        eos_token_id=None,
        pad_token_id=None,
    )
    with torch.device(device):
        model: Any = LlamaForCausalLM(config).to(torch.float32 if small else torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, fn: Callable[[], Any]) -> float:
    """Seconds `fn()` takes, the device's queued work included."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def first_token(model: Any, ids: torch.Tensor, cache: Any = None) -> None:
    """Generate the first new token of `ids` (`max_new_tokens=1`), optionally with a cache."""
    extra = {} if cache is None else {CACHE: cache}
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, **extra)


def ready_cache(kv: Any, length: int) -> DynamicCache:
    """A `DynamicCache` holding the first `length` tokens of `kv` (views: what an ideal store hands over)."""
    ready = DynamicCache()
    for i, layer in enumerate(kv.layers):
        ready.update(layer.keys[..., :length, :], layer.values[..., :length, :], i)
    return ready


def time_hits(model: Any, device: str, n: int, reps: int, gen: torch.Generator, vocab: int) -> tuple[float, ...]:
    """Median seconds of cold, hit and ideal first tokens for an `n`-token prompt, and the median of the
    repetitions' own hit/ideal ratios (each hit timed beside its ideal, so a slow spell of the card
    weighs on both)."""
    prefix = torch.randint(10, vocab, (1, n - TAIL), generator=gen).to(device)
    store = PrefixCache(model)
    with torch.no_grad():
        kv = model(prefix, use_cache=True).past_key_values
    first_token(model, prefix, store)
    samples: dict[str, list[float]] = {"cold": [], "hit": [], "ideal": []}
    for rep in range(reps + 1):
        suffix = torch.randint(10, vocab, (1, TAIL), generator=gen).to(device)
        suffix[0, 0] = 5 + rep  # a new first token each time: the match is exactly the prefix
        ids = torch.cat([prefix, suffix], 1)
        ready = ready_cache(kv, n - TAIL)  # built before the clock starts, as a store's restore would be ready
        times = {
            name: timed(device, functools.partial(first_token, model, ids, cache))
            for name, cache in (("cold", None), ("hit", store), ("ideal", ready))
        }
        if rep:  # the first round warms kernels up
            for name, seconds in times.items():
                samples[name].append(seconds)
    assert store.stats().hit_tokens == (reps + 1) * (n - TAIL), store.stats()
    store.detach()
    paired = statistics.median(h / i for h, i in zip(samples["hit"], samples["ideal"], strict=True))
    return (*(statistics.median(samples[name]) for name in ("cold", "hit", "ideal")), paired)


def profile_hits(model: Any, device: str, n: int, gen: torch.Generator, vocab: int, count: int = 20) -> None:
    """Print the store's hottest functions over `count` hits of an `n`-token prompt (host time, cProfile)."""
    prefix = torch.randint(10, vocab, (1, n - TAIL), generator=gen).to(device)
    store = PrefixCache(model)
    first_token(model, prefix, store)
    tails = [torch.randint(10, vocab, (1, TAIL), generator=gen).to(device) for _ in range(count + 1)]
    prompts = [torch.cat([prefix, tail], 1) for tail in tails]
    first_token(model, prompts[0], store)
    profiler = cProfile.Profile()
    sync(device)
    profiler.enable()
    for ids in prompts[1:]:
        first_token(model, ids, store)
        sync(device)
    profiler.disable()
    store.detach()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).sort_stats("cumulative")
    stats.print_stats("hf_prefix_cache", 25)
    print(f"\nprofile of {count} hits at {n} tokens (cumulative seconds, functions of hf_prefix_cache):")
    print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[:6000])


def raw_bandwidth(device: str, nbytes: int, reps: int = 5) -> tuple[float, float]:
    """Measured GB/s of one copy of `nbytes` device -> page-locked host, and back."""
    pin = device.startswith("cuda")
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    down = [timed(device, lambda: host.copy_(src, non_blocking=pin)) for _ in range(reps)]
    up = [timed(device, lambda: src.copy_(host, non_blocking=pin)) for _ in range(reps)]
    return nbytes / statistics.median(down) / 1e9, nbytes / statistics.median(up) / 1e9


def time_tiers(model: Any, device: str, n: int, gen: torch.Generator, vocab: int, rounds: int = 4) -> None:
    """Print GB/s of the host tier's moves beside the card's raw page-locked copies."""
    prefix = torch.randint(10, vocab, (1, n), generator=gen).to(device)
    store = PrefixCache(model, max_host_bytes="64GB")
    first_token(model, prefix, store)
    nbytes = store.stats().device_nbytes
    raw_down, raw_up = raw_bandwidth(device, nbytes)
    down, up = [], []
    for _ in range(rounds):
        down.append(timed(device, lambda: setattr(store, "max_bytes", 0)))
        assert store.stats().host_nbytes == nbytes and store.stats().device_nbytes == 0, store.stats()
        store.max_bytes = 2 * nbytes
        up.append(timed(device, lambda: store.lookup(prefix).release()))
        assert store.stats().device_nbytes == nbytes, store.stats()
    store.check_integrity()
    store.detach()

    def rate(seconds: float) -> float:
        return nbytes / seconds / 1e9

    steady_down, steady_up = rate(statistics.median(down[1:])), rate(statistics.median(up[1:]))
    print(f"\nhost tier: {nbytes / 1e6:.1f} MB entry ({n} tokens), GB/s")
    print(f"{'direction':>27s} {'raw':>7s} {'first':>7s} {'steady':>7s} {'steady/raw':>11s}")
    for label, raw, first, steady in (
        ("device -> pinned host", raw_down, rate(down[0]), steady_down),
        ("pinned host -> device (hit)", raw_up, rate(up[0]), steady_up),
    ):
        print(f"{label:>27s} {raw:7.2f} {first:7.2f} {steady:7.2f} {steady / raw:11.2f}")


def time_host_hits(model: Any, device: str, n: int, reps: int, gen: torch.Generator, vocab: int) -> None:
    """Print first-token ms of a hit whose `n - TAIL`-token prefix is in host memory: overlapped, copied first,
    and on the device."""
    prefix = torch.randint(10, vocab, (1, n - TAIL), generator=gen).to(device)
    store = PrefixCache(model, max_host_bytes="64GB")
    first_token(model, prefix, store)
    budget = store.max_bytes
    samples: dict[str, list[float]] = {"overlapped": [], "copy first": [], "on device": []}

    def hit(rep: int, offloaded: bool, by_layer: bool) -> float:
        suffix = torch.randint(10, vocab, (1, TAIL), generator=gen).to(device)
        suffix[0, 0] = 5 + rep % 200
        ids = torch.cat([prefix, suffix], 1)
        if offloaded:
            store.max_bytes = 0  # everything to the host tier
            store.max_bytes = budget
            sync(device)
        original = WorkingCache.defers_keys
        if not by_layer:
            WorkingCache.defers_keys = property(lambda self: False)  # type: ignore[method-assign,assignment]
        try:
            return timed(device, functools.partial(first_token, model, ids, store))
        finally:
            WorkingCache.defers_keys = original  # type: ignore[method-assign]

    for rep in range(reps + 1):
        times = {
            "overlapped": hit(3 * rep, True, True),
            "copy first": hit(3 * rep + 1, True, False),
            "on device": hit(3 * rep + 2, False, True),
        }
        if rep:
            for name, seconds in times.items():
                samples[name].append(seconds)
    store.check_integrity()
    store.detach()
    medians = {name: statistics.median(values) * 1e3 for name, values in samples.items()}
    print(f"\nhit from host memory: {n}-token prompt, prefix of {n - TAIL} on the host tier, first-token ms")
    print(" ".join(f"{name:>11s}" for name in medians) + f" {'copy first/overlapped':>22s}")
    print(
        " ".join(f"{ms:11.2f}" for ms in medians.values()) + f" {medians['copy first'] / medians['overlapped']:22.3f}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="prompts of 512 and 2048 tokens only")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a small float32 model (a dry run on the CPU)")
    parser.add_argument("--profile", action="store_true", help="print the store's hottest functions on a hit")
    parser.add_argument("--lengths", type=int, nargs="+", help="prompt lengths (default 512 to 32768)")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("bench_cuda needs a CUDA device; none is available here (--device cpu --small runs a dry run)")
    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    lengths = [512, 2048] if args.quick else [512, 2048, 4096, 8192, 32768]
    if args.small:
        lengths = [128, 512]
    lengths = args.lengths or lengths
    model = build_llama(args.device, args.small)
    vocab = model.config.vocab_size - 1
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "CPU"
    print(f"device: {name}; torch {torch.__version__}; transformers {transformers.__version__}; {hub_kernels()}")
    print(f"model: {'small float32' if args.small else 'Llama-3.2-1B shape, random weights, bfloat16'}\n")
    columns = ("cold ms", "hit ms", "ideal ms", "store ms", "cold/hit", "hit/ideal")
    print(f"{'prompt':>7s} " + " ".join(f"{c:>9s}" for c in columns))
    gen = torch.Generator().manual_seed(0)
    for n in lengths:
        cold, hit, ideal, paired = time_hits(model, args.device, n, args.reps, gen, vocab)
        cold, hit, ideal = cold * 1e3, hit * 1e3, ideal * 1e3
        print(f"{n:7d} {cold:9.2f} {hit:9.2f} {ideal:9.2f} {hit - ideal:9.2f} {cold / hit:8.1f}x {paired:9.3f}")
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    if args.profile:
        for n in sorted({lengths[0], lengths[-1]}):
            profile_hits(model, args.device, n, gen, vocab)
    time_tiers(model, args.device, lengths[-1], gen, vocab)
    for n in sorted({lengths[0], lengths[-1]}):
        time_host_hits(model, args.device, n, args.reps, gen, vocab)


if __name__ == "__main__":
    main()
