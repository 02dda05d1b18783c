"""A hit on a prefix that lies in two runs (a shared head and a branch's own tokens): joined before the
prefill against joined by each layer's first update, side by side, by prompt length.

A store holds a prompt of `n` tokens, then a branch that shares its first half and continues with
tokens of its own, which go into a run of their own. Every hit continues that branch with new last
tokens (`generate(max_new_tokens=1)`), so its prefix is two pieces: the shared half and the branch's
tokens. `joined first` concatenates them for every layer before the prefill, as every restore did
before (and as models with sliding or recurrent layers still do); `by first update` sets each layer
to the first piece and hands the others to its first `update` in front of the new keys, so
transformers' own concatenation joins all in one copy. `ideal` is the same call on a `DynamicCache`
holding the prefix in one piece. Each line is the median of the repetitions, the three variants
interleaved so a slow spell weighs on all of them; `first/update` above 1 means the change pays.

The model is `bench_host.py`'s 16-layer Llama of width 64, float32, on the CPU. Run:
``PYTHONPATH=. python benchmarks/bench_branch.py`` (about 1 min on 2 idle cores).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from typing import Any

import torch
from _common import CACHE, print_end, print_environment, start_run
from bench_cuda import TAIL, first_token, ready_cache
from bench_host import narrow_llama

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.model.working_cache import WorkingCache


def measure(model: Any, n: int, reps: int, gen: torch.Generator) -> dict[str, float]:
    """Median seconds of a hit joined first, joined by the first update, and the ideal, for an `n`-token prompt."""
    vocab = model.config.vocab_size - 1
    head = torch.randint(10, vocab, (1, n // 2), generator=gen)
    store = PrefixCache(model)
    first_token(model, torch.cat([head, torch.randint(10, vocab, (1, n // 2), generator=gen)], 1), store)
    branch = torch.cat([head, torch.randint(10, vocab, (1, n // 2 - TAIL), generator=gen)], 1)
    branch[0, n // 2] = 3  # differs from the first prompt right after the shared half
    stored = model.generate(
        branch, attention_mask=torch.ones_like(branch), max_new_tokens=1, do_sample=False, **{CACHE: store}
    )
    firsts = (t for t in itertools.count(5) if t != int(stored[0, -1]))  # never the token stored after the branch
    with torch.no_grad():
        kv = model(branch, use_cache=True).past_key_values
    by_layer = WorkingCache.defers_keys
    samples: dict[str, list[float]] = {"joined first": [], "by first update": [], "ideal": []}
    for rep in range(reps + 1):
        for name in samples:
            suffix = torch.randint(10, vocab, (1, TAIL), generator=gen)
            suffix[0, 0] = next(firsts)  # a new first token each time: the match is exactly the prefix
            ids = torch.cat([branch, suffix], 1)
            cache: Any = ready_cache(kv, branch.shape[1]) if name == "ideal" else store
            if name == "joined first":
                WorkingCache.defers_keys = property(lambda self: False)  # type: ignore[method-assign,assignment]
            try:
                start = time.perf_counter()
                first_token(model, ids, cache)
                seconds = time.perf_counter() - start
            finally:
                WorkingCache.defers_keys = by_layer  # type: ignore[method-assign]
            if rep:  # the first round warms up
                samples[name].append(seconds)
    assert store.stats().hit_tokens >= (reps + 1) * 2 * branch.shape[1], store.stats()
    store.detach()
    return {name: statistics.median(values) for name, values in samples.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steadier on a shared CPU)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 32768])
    args = parser.parse_args(argv)
    started = start_run(args.threads)
    print_environment(f"; 16-layer Llama of width 64, float32, {args.threads} thread(s)")
    model = narrow_llama(16)
    gen = torch.Generator().manual_seed(0)
    print(
        f"\n{'prompt':>7s} {'joined first ms':>16s} {'by first update ms':>19s} {'ideal ms':>9s} {'first/update':>13s}"
    )
    for n in args.lengths:
        t = measure(model, n, args.reps, gen)
        first, update, ideal = t["joined first"] * 1e3, t["by first update"] * 1e3, t["ideal"] * 1e3
        print(f"{n:7d} {first:16.2f} {update:19.2f} {ideal:9.2f} {first / update:13.3f}")
    print_end(started, newline=True)


if __name__ == "__main__":
    main()
