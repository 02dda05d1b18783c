"""End-to-end `generate` timings: cold prompt vs prefix hit through a `PrefixCache` vs an ideal reuse.

Model: a tiny random-weight Llama (defaults: 8 layers, hidden 512, intermediate 1376, 8 heads,
4 KV heads, vocab 32000, float32, CPU, the default attention implementation), seeded with
``torch.manual_seed(0)``, ``eos_token_id = None`` so every call yields exactly
``max_new_tokens`` tokens, greedy decoding.

Scenario: a shared ``--prefix-len`` (2,000) token prefix followed by a ``--suffix-len`` (50)
token suffix. Three ways to run the same full prompt, measured interleaved in one process:

* ``cold``:  ``model.generate(prompt)`` with no store (the whole prompt is prefilled);
* ``hit``:   ``model.generate(prompt, past_key_values=store)``; the store already holds the
  prefix, and every repetition uses a fresh suffix whose first token no earlier suffix had,
  so the stored match is always exactly the prefix (checked with ``store.stats()``);
* ``ideal``: ``model.generate(prompt, past_key_values=cache)`` where ``cache`` is a plain
  ``DynamicCache`` already holding the prefix keys/values. It is built outside the timed
  region as views of one prefix forward (transformers grows a ``DynamicLayer`` with
  ``torch.cat`` and never writes its tensors in place, so the views are never modified).
  It is what reuse costs with zero bookkeeping: the floor for ``hit``.

``hit/ideal`` is the store's overhead on a hit (target <= 1.05); ``cold/hit`` is the speedup.
Two variants: ``max_new_tokens=1`` (prompt work only, TTFT-like) and ``--gen-tokens`` (32).

Miss overhead: ``--miss-len`` (512) token random prompts with ``--miss-new-tokens`` (16) new
tokens, plain ``generate`` vs ``generate`` through a store that holds only unrelated entries
(every prompt starts with a token no stored entry starts with, so nothing matches).
Target: store/plain < 1.03.

Every number is the median over repetitions after warm-up; variants are interleaved per
repetition so that machine noise hits them alike.

Run: ``PYTHONPATH=. python benchmarks/bench_generate.py`` (``--quick`` for a smoke run,
``--profile`` to cProfile a few hit calls).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
from typing import Any

import torch
import transformers
from _common import CACHE, Timings, hub_kernels, load_average, print_end, start_run, timed, tiny_llama
from transformers import DynamicCache

from hf_prefix_cache import PrefixCache

# Token ids below this are left to special tokens; prompts never use them.
_FIRST_ID = 4


class PromptSource:
    """Random prompts whose first token is new every time, so the radix tree branches right there."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self._gen = torch.Generator().manual_seed(seed)
        self._vocab_size = vocab_size
        self._used_first: set[int] = set()

    def fresh(self, length: int, avoid_first: set[int] | None = None) -> torch.Tensor:
        """`[1, length]` random ids whose first id was never returned first before (nor is in `avoid_first`)."""
        avoid = self._used_first | (avoid_first or set())
        while True:
            ids = torch.randint(_FIRST_ID, self._vocab_size, (1, length), generator=self._gen)
            first = int(ids[0, 0])
            if first not in avoid:
                self._used_first.add(first)
                return ids


def build_model(args: argparse.Namespace) -> Any:
    """The random-weight tiny Llama described in the module docstring."""
    return tiny_llama(args, args.prefix_len + args.suffix_len + args.gen_tokens + 8)


def view_cache(model: Any, source: DynamicCache) -> DynamicCache:
    """A fresh `DynamicCache` whose layers hold `source`'s tensors (views, no copy)."""
    cache = DynamicCache(config=model.config)
    layer: Any
    src: Any
    for layer, src in zip(cache.layers, source.layers, strict=True):
        layer.dtype, layer.device = src.keys.dtype, src.keys.device
        layer.keys, layer.values = src.keys, src.values
        layer.is_initialized = True
    return cache


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:10.1f}"


def run_reuse(
    model: Any,
    store: PrefixCache,
    prefix: torch.Tensor,
    prefix_cache: DynamicCache,
    prompts: PromptSource,
    args: argparse.Namespace,
    new_tokens: int,
    reps: int,
    fast_reps: int,
) -> tuple[Timings, int]:
    """Interleave cold / hit / ideal on the same fresh prompt per repetition; returns timings and mismatches.

    `cold` runs in the first `reps` repetitions only (it is slow), `hit` and `ideal` in all `fast_reps`.
    The first repetition is a warm-up and is not recorded.
    """
    timings = Timings()
    mismatches = 0
    total = max(reps, fast_reps) + 1
    for rep in range(total):
        record = rep > 0
        suffix = prompts.fresh(args.suffix_len)
        prompt = torch.cat([prefix, suffix], dim=1)
        kwargs: dict[str, Any] = {"max_new_tokens": new_tokens, "do_sample": False}

        outs: dict[str, torch.Tensor] = {}
        if rep <= reps:
            seconds, outs["cold"] = timed(model.generate, prompt, **kwargs)
            if record:
                timings.add("cold", seconds)

        before = store.stats().hit_tokens
        cache = view_cache(model, prefix_cache)  # built outside the timed region
        variants = {"hit": store, "ideal": cache}
        # Alternate the order so neither variant always runs second (warmer caches).
        for name in ("hit", "ideal") if rep % 2 == 0 else ("ideal", "hit"):
            seconds, outs[name] = timed(model.generate, prompt, **{CACHE: variants[name]}, **kwargs)
            if record:
                timings.add(name, seconds)
        reused = store.stats().hit_tokens - before
        if reused != args.prefix_len:
            raise RuntimeError(f"the hit reused {reused} tokens, expected exactly the {args.prefix_len}-token prefix")
        if any(not torch.equal(out, outs["hit"]) for out in outs.values()):
            mismatches += 1
    return timings, mismatches


def run_multiturn(
    model: Any,
    store: PrefixCache,
    prefix: torch.Tensor,
    prefix_cache: DynamicCache,
    prompts: PromptSource,
    args: argparse.Namespace,
    reps: int,
) -> Timings:
    """Second turns of conversations that share the prefix: hit vs ideal with max_new_tokens=1.

    Per repetition (untimed): turn 1 = prefix + a fresh suffix goes through the store, and an
    ideal cache of turn 1 is built by feeding the suffix on views of the prefix cache. Timed:
    turn 2 = turn 1 + another fresh suffix, through the store (it reuses all of turn 1, whose
    stored keys lie in two runs: the shared prefix's and this conversation's own tail) and on
    the ideal cache.
    """
    timings = Timings()
    kwargs: dict[str, Any] = {"max_new_tokens": 1, "do_sample": False}
    for rep in range(reps + 1):
        turn1 = torch.cat([prefix, prompts.fresh(args.suffix_len)], dim=1)
        model.generate(turn1, **{CACHE: store}, **kwargs)
        turn1_cache = view_cache(model, prefix_cache)
        with torch.no_grad():
            model(turn1[:, args.prefix_len :], **{CACHE: turn1_cache}, use_cache=True)
        turn2 = torch.cat([turn1, prompts.fresh(args.suffix_len)], dim=1)
        before = store.stats().hit_tokens
        variants = {"hit": store, "ideal": view_cache(model, turn1_cache)}
        for name in ("hit", "ideal") if rep % 2 == 0 else ("ideal", "hit"):
            seconds, _ = timed(model.generate, turn2, **{CACHE: variants[name]}, **kwargs)
            if rep > 0:
                timings.add(name, seconds)
        if store.stats().hit_tokens - before != turn1.shape[1]:
            raise RuntimeError("a second turn did not reuse exactly its first turn")
    return timings


def run_miss(model: Any, store: PrefixCache, prompts: PromptSource, args: argparse.Namespace, reps: int) -> Timings:
    """Plain generate vs generate through a store where nothing matches, same fresh prompt per repetition."""
    timings = Timings()
    kwargs: dict[str, Any] = {"max_new_tokens": args.miss_new_tokens, "do_sample": False}
    for rep in range(reps + 1):
        prompt = prompts.fresh(args.miss_len)
        before = store.stats()

        for name in ("plain", "store") if rep % 2 == 0 else ("store", "plain"):
            extra = {CACHE: store} if name == "store" else {}
            seconds, _ = timed(model.generate, prompt, **kwargs, **extra)
            if rep > 0:
                timings.add(name, seconds)
        after = store.stats()
        if after.hit_tokens != before.hit_tokens or after.requests != before.requests + 1:
            raise RuntimeError("the miss benchmark hit the store or fell back; prompts are not unrelated")
    return timings


def print_reuse_table(title: str, timings: Timings) -> None:
    cold, hit, ideal = (timings.median(n) for n in ("cold", "hit", "ideal"))
    print(f"\n{title}")
    print(f"  {'variant':<8}{'median ms':>10}{'reps':>6}")
    for name in ("cold", "hit", "ideal"):
        print(f"  {name:<8}{fmt_ms(timings.median(name))}{len(timings.samples[name]):>6}")
    print(f"  hit/ideal  = {hit / ideal:6.3f}   (target <= 1.05; hit - ideal = {(hit - ideal) * 1e3:+.2f} ms)")
    print(f"  cold/hit   = {cold / hit:6.2f}x  (speedup of a prefix hit over a cold prompt)")
    print(f"  cold/ideal = {cold / ideal:6.2f}x")


def profile_hits(
    model: Any,
    store: PrefixCache,
    prefix: torch.Tensor,
    prompts: PromptSource,
    args: argparse.Namespace,
    calls: int = 10,
) -> None:
    """cProfile `calls` hit generates (max_new_tokens=1) and print the top functions by own and cumulative time."""
    profiler = cProfile.Profile()
    before = store.stats().hit_tokens
    for _ in range(calls):
        prompt = torch.cat([prefix, prompts.fresh(args.suffix_len)], dim=1)
        profiler.enable()
        model.generate(prompt, **{CACHE: store}, max_new_tokens=1, do_sample=False)
        profiler.disable()
    if store.stats().hit_tokens - before != calls * args.prefix_len:
        raise RuntimeError("a profiled call did not reuse exactly the prefix")
    for key in ("cumulative", "tottime"):
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats(key).print_stats(25)
        print(f"\ncProfile of {calls} hit calls, sorted by {key}:")
        print(buf.getvalue())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1376)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prefix-len", type=int, default=2000, help="shared prefix tokens (default 2000)")
    p.add_argument("--suffix-len", type=int, default=50, help="fresh suffix tokens per repetition (default 50)")
    p.add_argument("--gen-tokens", type=int, default=32, help="new tokens of the longer variant (default 32)")
    p.add_argument("--reps", type=int, default=5, help="measured repetitions of the cold runs (default 5)")
    p.add_argument("--fast-reps", type=int, default=15, help="measured repetitions of hit/ideal (default 15)")
    p.add_argument("--miss-len", type=int, default=512, help="prompt tokens of the miss benchmark (default 512)")
    p.add_argument("--miss-new-tokens", type=int, default=16)
    p.add_argument("--miss-reps", type=int, default=9)
    p.add_argument("--unrelated", type=int, default=4, help="unrelated entries stored before the miss benchmark")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--profile", action="store_true", help="also cProfile 10 hit calls")
    p.add_argument("--quick", action="store_true", help="small sizes and few repetitions (smoke run, < 30 s)")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.prefix_len, args.suffix_len, args.gen_tokens = 2, 256, 16, 4
        args.reps, args.fast_reps, args.miss_len, args.miss_new_tokens, args.miss_reps = 1, 2, 64, 4, 2
        args.unrelated = 1
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = start_run(args.threads)
    model = build_model(args)
    store = PrefixCache(model, max_bytes="8GiB")
    prompts = PromptSource(args.vocab, seed=1)
    print(
        f"tiny Llama: {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, "
        f"{args.heads} heads, {args.kv_heads} KV heads, vocab {args.vocab}, {model.dtype}, "
        f"attn={model.config._attn_implementation}, torch threads={torch.get_num_threads()}"
    )
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {hub_kernels()}")
    print(f"prompt = {args.prefix_len}-token shared prefix + {args.suffix_len}-token fresh suffix, greedy")
    print(f"load average at start: {load_average()} on {os.cpu_count()} CPUs (other processes skew every timing)")

    prefix = prompts.fresh(args.prefix_len)
    with torch.no_grad():
        prefix_cache = model(prefix, use_cache=True).past_key_values
    # Store the prefix (with a throwaway suffix); later suffixes never start with the same token.
    model.generate(torch.cat([prefix, prompts.fresh(args.suffix_len)], dim=1), **{CACHE: store}, max_new_tokens=1)

    ttft, bad_ttft = run_reuse(model, store, prefix, prefix_cache, prompts, args, 1, args.reps, args.fast_reps)
    print_reuse_table("max_new_tokens=1 (prompt work, TTFT-like)", ttft)
    gen_reps = max(args.reps, args.fast_reps // 2)
    gen, bad_gen = run_reuse(model, store, prefix, prefix_cache, prompts, args, args.gen_tokens, args.reps, gen_reps)
    print_reuse_table(f"max_new_tokens={args.gen_tokens}", gen)
    print(f"  output mismatches between cold/hit/ideal: {bad_ttft} (1 token), {bad_gen} ({args.gen_tokens} tokens)")

    turns = run_multiturn(model, store, prefix, prefix_cache, prompts, args, args.fast_reps)
    hit, ideal = turns.median("hit"), turns.median("ideal")
    reused = args.prefix_len + args.suffix_len
    print(f"\nsecond turn, max_new_tokens=1: reuses the prefix + the first turn's suffix ({reused} tokens, 2 runs)")
    print(f"  {'variant':<8}{'median ms':>10}{'reps':>6}")
    for name in ("hit", "ideal"):
        print(f"  {name:<8}{fmt_ms(turns.median(name))}{len(turns.samples[name]):>6}")
    print(f"  hit/ideal  = {hit / ideal:6.3f}   (target <= 1.05; hit - ideal = {(hit - ideal) * 1e3:+.2f} ms)")

    # Unrelated entries for the miss benchmark (their first tokens are never reused by PromptSource).
    for _ in range(args.unrelated):
        model.generate(prompts.fresh(args.miss_len), **{CACHE: store}, max_new_tokens=1)
    miss = run_miss(model, store, prompts, args, args.miss_reps)
    plain, through = miss.median("plain"), miss.median("store")
    print(f"\nmiss overhead: {args.miss_len}-token prompt, max_new_tokens={args.miss_new_tokens}, nothing matches")
    print(f"  {'variant':<8}{'median ms':>10}{'reps':>6}")
    for name in ("plain", "store"):
        print(f"  {name:<8}{fmt_ms(miss.median(name))}{len(miss.samples[name]):>6}")
    print(f"  store/plain = {through / plain:6.3f}   (target < 1.03; {(through - plain) * 1e3:+.2f} ms)")

    stats = store.stats()
    print(
        f"\nstore: {stats.entries} entries, {stats.nodes} nodes, {stats.nbytes / 2**20:.1f} MiB, "
        f"{stats.requests} requests, fallbacks {stats.fallbacks or 'none'}"
    )
    if args.profile:
        profile_hits(model, store, prefix, prompts, args)
    print_end(started)


if __name__ == "__main__":
    main()
