"""Does a hybrid's prompt-end snapshot pay for itself? Hit rate gained against time lost, chat and repeat.

With ``prompt_snapshot=True`` (the default) a model with recurrent layers prefills its uncached
prompt up to the last token but one itself, snapshots the state there, and `generate` feeds
the last token in a forward of its own: one forward more per request, but the same prompt sent
again reuses all but its last token. With ``False`` the whole uncached prompt goes to
`generate` in one forward, and only answer-end, divergence and interval snapshots are taken.

Workloads (tiny random-weight Bamba, one attention layer in four, Mamba-2 elsewhere):

* ``chat``: a conversation of `--turns` turns; each prompt is the previous prompt, its answer
  and `--user` new tokens (reused from the previous answer-end snapshot either way);
* ``repeat``: one prompt of `--prompt` tokens sent `--turns` times (a regenerate, a shared
  system prompt asked again);
* ``regenerate``: the chat, where each turn is asked twice (the user regenerates the answer).

Printed per workload and setting: prompt tokens reused of all prompt tokens, forwards run by
the model, and the median and total seconds of the requests after the first; then the ratio of
total times (off / on): above 1 the split pays for itself.

Run: ``PYTHONPATH=. python benchmarks/bench_prompt_snapshot.py --threads 1`` (about 15 s), or with
``--hidden 256 --prompt 1000 --user 100 --turns 4`` (about 30 s; `results/prompt_snapshot.txt`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from _common import CACHE, print_end, print_environment, start_run
from bench_ops import build

from hf_prefix_cache import PrefixCache


def _workload(name: str, args: argparse.Namespace, model: Any, store: PrefixCache) -> list[float]:
    """Run `name`'s requests through `store`; seconds per request."""
    g = torch.Generator().manual_seed(1)
    seconds: list[float] = []

    def ask(ids: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        mask = torch.ones_like(ids)  # random weights may answer the pad id: say it is no padding
        out = model.generate(ids, attention_mask=mask, **{CACHE: store}, max_new_tokens=args.answer)
        seconds.append(time.perf_counter() - start)
        return out  # type: ignore[no-any-return]

    if name == "repeat":
        ids = torch.randint(4, 100, (1, args.prompt), generator=g)
        for _ in range(args.turns):
            ask(ids)
        return seconds
    ids = torch.randint(4, 100, (1, args.prompt), generator=g)
    for _ in range(args.turns):
        out = ask(ids)
        if name == "regenerate":
            out = ask(ids)
        ids = torch.cat([out, torch.randint(4, 100, (1, args.user), generator=g)], dim=1)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=400)
    parser.add_argument("--user", type=int, default=40)
    parser.add_argument("--answer", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    started = start_run(args.threads)
    print_environment(f", Bamba shape, {args.layers} layers, hidden {args.hidden}")
    model = build("hybrid", args.layers, args.hidden)
    forwards = [0]
    model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    print(f"{'workload':>10} {'prompt_snapshot':>15} {'reused':>14} {'forwards':>8} {'median s':>9} {'total s':>8}")
    for name in ("chat", "repeat", "regenerate"):
        totals = {}
        for setting in (True, False):
            store = PrefixCache(model, prompt_snapshot=setting)
            forwards[0] = 0
            seconds = _workload(name, args, model, store)
            stats = store.stats()
            store.detach()
            later = seconds[1:]
            totals[setting] = sum(later)
            reused = f"{stats.hit_tokens}/{stats.prompt_tokens}"
            print(
                f"{name:>10} {setting!s:>15} {reused:>14} {forwards[0]:>8} {statistics.median(later):>9.4f} "
                f"{sum(later):>8.3f}"
            )
        print(f"{name:>10} {'off/on':>15} {'':>14} {'':>8} {'':>9} {totals[False] / totals[True]:>8.2f}")
    print_end(started)


if __name__ == "__main__":
    main()
