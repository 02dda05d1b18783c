"""A model loaded in a thread that exits (`threads.in_passing_thread`; `hf-prefix-cache serve` loads every model so).

OpenMP gives each thread that runs a parallel loop a pool of threads of its own, kept until that thread exits;
a main thread that loaded the model keeps its pool for the process's life, and beside the generating thread's
pool the process then holds more OpenMP threads than cores, which made a SmolLM2 step on 2 cores 23% slower
(`docs/serving.md`, "Where the loop runs, and where the model was loaded"). These check the mechanism the fix
relies on, in a fresh process (a pool made by an earlier test would hide it): a parallel loop in the main thread leaves its pool's threads
behind, the same loop run through `in_passing_thread` leaves none, and what it returns or raises comes back.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hf_prefix_cache._compat import serve_requirement
from hf_prefix_cache.batching.threads import in_passing_thread

ROOT = Path(__file__).resolve().parents[2]

PROBE = textwrap.dedent(
    """
    import os, sys, time
    import torch
    from hf_prefix_cache.batching.threads import in_passing_thread

    torch.set_num_threads(2)

    def threads():
        return len(os.listdir("/proc/self/task"))

    def parallel_loop():
        x = torch.randn(1 << 22)
        return float((x.exp() * 2).sum())  # large enough for torch to run it on its 2 threads

    before = threads()
    in_passing_thread(parallel_loop)
    waited = 0.0
    while threads() > before and waited < 10:  # the thread and its pool end just after `join` returns
        time.sleep(0.05)
        waited += 0.05
    passing = threads()
    parallel_loop()
    main = threads()
    print(before, passing, main)
    """
)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc")
def test_a_parallel_loop_run_in_a_passing_thread_leaves_no_threads_behind() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, timeout=120, check=True
    ).stdout.split()
    before, passing, main = (int(n) for n in out[-3:])
    assert passing == before, (before, passing, main)
    assert main > passing, "the main thread's parallel loop left no pool: the probe no longer shows the mechanism"


def test_what_the_function_returns_or_raises_comes_back() -> None:
    seen: list[str] = []

    def work() -> int:
        import threading

        seen.append(threading.current_thread().name)
        return 42

    assert in_passing_thread(work) == 42
    assert seen == ["hf-prefix-cache-load"]

    error = ValueError("the model's folder holds no config.json")

    def fails() -> None:
        raise error

    with pytest.raises(ValueError) as raised:
        in_passing_thread(fails)
    assert raised.value is error


@pytest.mark.skipif(serve_requirement() is not None, reason=str(serve_requirement()))
def test_each_models_process_loads_its_model_in_a_passing_thread(tmp_path: Path) -> None:
    """`StoreLoader` (what each model's process of `hf-prefix-cache serve` loads with) loads the model, attaches its
    store and sets its linear kernels in a thread that has exited when the model comes back: the process's main
    thread keeps no OpenMP pool beside the loop's."""
    import signal
    import threading
    from typing import Any

    from hf_prefix_cache.api.models import ModelUnavailableError
    from hf_prefix_cache.frontends.serve.engine import ENGINE, StoreLoader
    from hf_prefix_cache.testing.serve_process import tiny_chat_folder

    try:
        folder = tiny_chat_folder(tmp_path)
    except ModelUnavailableError as exc:
        pytest.skip(f"SmolLM2's tokenizer: {exc}")
    loaded_in: list[threading.Thread] = []

    class Watched(StoreLoader):
        def _load(self, model_id: str, on_progress: Any) -> Any:
            loaded_in.append(threading.current_thread())
            return super()._load(model_id, on_progress)

    kept = (ENGINE.model_id, ENGINE.store, ENGINE.batch, ENGINE.linear_kernels)
    on_sigterm = signal.getsignal(signal.SIGTERM)  # the loader sets its own in the main thread
    try:
        model, _ = Watched({}, device="cpu", cpu_linear="torch").load_model_and_processor(folder)
        assert len(loaded_in) == 1 and loaded_in[0] is not threading.current_thread()
        assert not loaded_in[0].is_alive()
        assert ENGINE.store is not None and ENGINE.store.model is model
        assert ENGINE.linear_kernels is not None and ENGINE.linear_kernels.kernel == "torch"
    finally:
        if ENGINE.store is not None and ENGINE.store is not kept[1]:
            ENGINE.store.detach()
        ENGINE.model_id, ENGINE.store, ENGINE.batch, ENGINE.linear_kernels = kept
        signal.signal(signal.SIGTERM, on_sigterm)
