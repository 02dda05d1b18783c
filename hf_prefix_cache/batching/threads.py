"""Torch's CPU threads and the thread that drives the model: load in a thread that exits (`in_passing_thread`).

torch runs its parallel CPU loops on OpenMP, and GNU's OpenMP (the one torch's CPU wheels carry) gives each
thread that runs a parallel loop a pool of worker threads of its own, kept until that thread exits. When the
process holds more OpenMP threads than the machine has cores, OpenMP stops spinning between two parallel loops
and sleeps instead, and every loop then waits for its threads to wake. A process whose main thread loaded the
model (a parallel loop or thousands) and whose decoding runs in another thread (the batching `Scheduler`'s
loop, a server's runner) holds two pools for good: on 2 CPU cores a SmolLM2 step of 8 rows used 1.49 cores
there (146 ms) against 1.99 (119 ms) with the model loaded in a thread that exited, and `hf-prefix-cache serve
--no-batch` decoded 12.3 tokens/s against 10.1 (`benchmarks/bench_loop_thread.py`; `docs/serving.md`, "Where
the loop runs, and where the model was loaded"). `hf-prefix-cache serve` loads every model through
`in_passing_thread`; a program that runs a `Scheduler` in a thread of its own can do the same.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def in_passing_thread(function: Callable[[], T]) -> T:
    """`function()` run in a thread of its own that exits when it returns: what it returns, or what it raised
    (raised again here). The OpenMP pool any parallel loop of `function` made leaves with that thread.

    Example:
        >>> in_passing_thread(lambda: 6 * 7)
        42
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = function()
        except BaseException as exc:  # raised again in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=run, name="hf-prefix-cache-load")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    result: T = box["result"]
    return result
