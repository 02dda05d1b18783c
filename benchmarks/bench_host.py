"""The store's host time per hit: what a hit spends outside `generate`, on the CPU, by prompt length.

On a GPU the store's Python work (reading the prompt, keying, matching, restoring, capturing and
inserting) runs while the device waits, so it adds to every hit whatever the card; a CPU measures
it as well as a GPU machine does. The model is a 16-layer Llama of tiny width (the layer count of
Llama-3.2-1B, which sets the per-layer work) so the forward itself is cheap.

For each prompt length a store holds the prompt minus its last 32 tokens; each hit brings new
last tokens (`generate(max_new_tokens=1)`). `store host ms` is the hit's wall time minus the time
spent inside the original `generate` (timed where the request path runs it), median over the
repetitions; `inside ms` is that inner time and `ideal ms` the same call on a ready
`DynamicCache`. `host/ideal` is the store's time as a share of the ideal call.

Run: ``PYTHONPATH=. python benchmarks/bench_host.py`` (about 1 min on 2 idle cores; ``--quick``
for 512 and 8192 tokens).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch
from _common import print_end, print_environment, start_run, tiny_llama
from bench_cuda import TAIL, first_token, ready_cache

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.hooks import pipeline


def narrow_llama(layers: int) -> Any:
    """The benchmarks' random-weight Llama with `layers` layers of width 64 (4 heads of 16, 2 KV heads), float32."""
    sizes = SimpleNamespace(vocab=1000, hidden=64, intermediate=64, layers=layers, heads=4, kv_heads=2)
    return tiny_llama(sizes, 65536)


@contextmanager
def inner_timer() -> Iterator[list[float]]:
    """Seconds spent in each call of the original `generate` on a served request (the `original` that the request
    path, `pipeline.serve`, runs), appended as they end."""
    spent: list[float] = []
    serve: Callable[..., Any] = pipeline.serve

    def timed_serve(store: Any, original: Callable[..., Any], *args: Any) -> Any:
        def timed(*call_args: Any, **call_kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*call_args, **call_kwargs)
            finally:
                spent.append(time.perf_counter() - start)

        return serve(store, timed, *args)

    pipeline.serve = timed_serve
    try:
        yield spent
    finally:
        pipeline.serve = serve


def measure(model: Any, n: int, reps: int, gen: torch.Generator) -> tuple[float, float, float]:
    """Median store host, inside and ideal seconds of hits on an `n`-token prompt."""
    vocab = model.config.vocab_size - 1
    prefix = torch.randint(10, vocab, (1, n - TAIL), generator=gen)
    with torch.no_grad():
        kv = model(prefix, use_cache=True).past_key_values
    store = PrefixCache(model)
    first_token(model, prefix, store)
    host, inside, ideal = [], [], []
    with inner_timer() as spent:
        for rep in range(reps + 1):
            suffix = torch.randint(10, vocab, (1, TAIL), generator=gen)
            suffix[0, 0] = 5 + rep  # a new first token each time: the match is exactly the prefix
            ids = torch.cat([prefix, suffix], 1)
            ready = ready_cache(kv, n - TAIL)
            start = time.perf_counter()
            first_token(model, ids, ready)
            ideal_s = time.perf_counter() - start
            spent.clear()
            start = time.perf_counter()
            first_token(model, ids, store)
            total = time.perf_counter() - start
            if rep:  # the first round warms up
                host.append(total - spent[0])
                inside.append(spent[0])
                ideal.append(ideal_s)
    assert store.stats().hit_tokens > 0, "the hits reused nothing"
    store.detach()
    return statistics.median(host), statistics.median(inside), statistics.median(ideal)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="512 and 8192 tokens only")
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--lengths", type=int, nargs="+")
    args = parser.parse_args(argv)
    started = start_run(1)
    print_environment(f"; {args.layers} layers of width 64, 1 thread")
    lengths = args.lengths or ([512, 8192] if args.quick else [512, 2048, 8192, 32768])
    model = narrow_llama(args.layers)
    gen = torch.Generator().manual_seed(0)
    print(f"\n{'prompt':>7s} {'store host ms':>14s} {'inside ms':>10s} {'ideal ms':>9s} {'host/ideal':>11s}")
    for n in lengths:
        host, inside, ideal = measure(model, n, args.reps, gen)
        print(f"{n:7d} {host * 1e3:14.3f} {inside * 1e3:10.2f} {ideal * 1e3:9.2f} {host / ideal:11.3f}")
    print_end(started, newline=True)


if __name__ == "__main__":
    main()
