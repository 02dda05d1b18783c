"""How much of the package one plain hit walks through: modules, functions and Python calls.

A maintainer reads a hit by following it; the fewer rooms and calls it crosses, the easier it is
to follow and the less host time it spends (on a GPU the store's Python work is what a hit adds to
a ready cache). A profile hook (`sys.setprofile`) counts every Python function call whose code
lives in `hf_prefix_cache/` (its `testing/` and `frontends/` excluded) during one `generate` that
extends a stored prompt, on a random-weight Llama of 2 layers: the store holds a 64-token prompt,
the hit brings 8 new tokens and generates 1. The counts are deterministic; run it before and after
a change to the core and compare.

Run: ``PYTHONPATH=. python benchmarks/bench_calls.py`` (a few seconds; ``--top N`` lists the N
most called functions, ``--modules`` lists the modules, ``--verbose`` lists each module's functions
under it with their calls).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from types import FrameType, SimpleNamespace
from typing import Any

import torch
from _common import CACHE, tiny_llama

import hf_prefix_cache
from hf_prefix_cache import PrefixCache

PACKAGE = Path(hf_prefix_cache.__file__).resolve().parent
EXCLUDED = ("testing", "frontends")


def package_module(filename: str) -> str | None:
    """The dotted package module a code object's file belongs to, or None outside the counted package."""
    try:
        relative = Path(filename).resolve().relative_to(PACKAGE)
    except ValueError:
        return None
    if relative.parts and relative.parts[0] in EXCLUDED:
        return None
    return ".".join(relative.with_suffix("").parts)


def count_calls(run: Any) -> Counter[tuple[str, str]]:
    """Calls into the package made while `run()` runs, by (module, function name)."""
    calls: Counter[tuple[str, str]] = Counter()
    modules: dict[str, str | None] = {}

    def profile(frame: FrameType, event: str, _arg: Any) -> None:
        if event != "call":
            return
        code = frame.f_code
        filename = code.co_filename
        module = modules.get(filename, "")
        if module == "":
            module = modules[filename] = package_module(filename)
        if module is not None:
            calls[module, code.co_qualname] += 1

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return calls


def one_hit(prompt_len: int, new_len: int) -> Counter[tuple[str, str]]:
    """The calls of one `generate` extending a stored `prompt_len`-token prompt by `new_len` tokens."""
    model = tiny_llama(SimpleNamespace(vocab=1000, hidden=64, intermediate=64, layers=2, heads=4, kv_heads=2), 4096)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, 999, (1, prompt_len), generator=gen)
    store = PrefixCache(model)
    model.generate(prompt, max_new_tokens=1, do_sample=False, **{CACHE: store})
    longer = torch.cat([prompt, torch.randint(10, 999, (1, new_len), generator=gen)], 1)
    model.generate(longer, max_new_tokens=1, do_sample=False, **{CACHE: store})  # warm: lazy imports, first uses
    even_longer = torch.cat([longer, torch.randint(10, 999, (1, new_len), generator=gen)], 1)
    before = store.stats().hit_tokens
    calls = count_calls(lambda: model.generate(even_longer, max_new_tokens=1, do_sample=False, **{CACHE: store}))
    reused = store.stats().hit_tokens - before
    assert reused >= prompt_len, f"the counted call reused {reused} tokens, not a hit"
    store.detach()
    return calls


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--top", type=int, default=0, help="list the N most called functions")
    parser.add_argument("--modules", action="store_true", help="list the modules and their call counts")
    parser.add_argument(
        "--verbose", action="store_true", help="list every module with its calls, and its functions under it"
    )
    args = parser.parse_args(argv)
    calls = one_hit(64, 8)
    by_module: Counter[str] = Counter()
    for (module, _), n in calls.items():
        by_module[module] += n
    print(
        f"one plain hit: {len(by_module)} package modules, {len(calls)} functions, "
        f"{sum(calls.values())} Python calls (testing/ and frontends/ excluded)"
    )
    if args.modules or args.verbose:
        for module, n in sorted(by_module.items()):
            print(f"  {n:5d}  {module}")
            if args.verbose:
                functions = sorted((name, k) for (m, name), k in calls.items() if m == module)
                for name, k in functions:
                    print(f"  {k:9d}  {name}")
    for (module, name), n in calls.most_common(args.top):
        print(f"  {n:5d}  {module}.{name}")


if __name__ == "__main__":
    main()
