"""The support matrix's worker pool: each model type runs in a worker process with a time limit.

A worker (``support_matrix.py --worker``) reads ``model_type<TAB>mappings`` lines and prints each
row as a marked JSON line; a hanging or crashing family costs its row, not the sweep. Workers exit
after `ROWS_PER_WORKER` rows (memory grows with every family's modules) or an allocation failure.
"""

from __future__ import annotations

import json
import os
import resource
import select
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from support_doc import Row

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "support_matrix.py"
MARK = "@@ROW "
#: Rows one worker runs before it exits and a fresh one starts.
ROWS_PER_WORKER = 10
#: Address-space limit of a worker process, bytes.
MEMORY_LIMIT = 4 * 2**30
#: timm and torchvision, which `scripts/install` puts here (``--no-deps``, beside the CPU torch). Only a
#: row whose model needs timm (a timm vision tower) runs with them, in a worker of its own: with timm
#: importable transformers picks other image processors, so no other row may see it.
TIMM_PACKAGES = ROOT / ".timm-packages"


def worker(timm: bool = False) -> None:
    """Read `model_type<TAB>mappings` lines on stdin; print each result as a marked JSON line.

    `timm`: with `TIMM_PACKAGES` importable, and the two torchvision op schemas its import needs
    declared (PyPI's torchvision cannot load its C++ ops beside a CPU torch), as Gemma 3n's tests do.
    """
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if timm:
        sys.path[:0] = [str(TIMM_PACKAGES), str(ROOT / "tests")]
        import support.torchvision_ops  # noqa: F401 - declares the schemas on import
    # A config the shrink misses can ask for gigabytes: fail that row (MemoryError), not the machine.
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    import transformers

    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]

    import support_matrix  # the worker's rows (support_matrix imports this module)

    for line in sys.stdin:
        model_type, mappings = line.rstrip("\n").split("\t")
        row = support_matrix.run_row(model_type, mappings.split(","))
        sys.stdout.write(MARK + json.dumps(asdict(row)) + "\n")
        sys.stdout.flush()
        if _out_of_memory(row):
            return  # the parent starts a fresh worker


class _Slot:
    """One worker process; restarted after a timeout or a crash."""

    def __init__(self, timm: bool = False) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.num_rows = 0
        self.timm = timm

    def _start(self) -> subprocess.Popen[str]:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        return subprocess.Popen(
            [sys.executable, str(SCRIPT), "--worker", *(["--timm"] if self.timm else [])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=ROOT,
        )

    def run(self, model_type: str, mappings: list[str], timeout: float) -> Row:
        row = self._run(model_type, mappings, timeout)
        if _out_of_memory(row):
            row = self._run(model_type, mappings, timeout)  # once more in a fresh worker
        self.num_rows += 1
        if self.num_rows % ROWS_PER_WORKER == 0:
            self.close()  # memory grows with every family's modules: start afresh
        return row

    def _run(self, model_type: str, mappings: list[str], timeout: float) -> Row:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        stdout = self.proc.stdout
        assert self.proc.stdin is not None and stdout is not None
        self.proc.stdin.write(f"{model_type}\t{','.join(mappings)}\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([stdout], [], [], max(left, 0))
            if not ready:
                self.proc.kill()
                self.proc.wait()
                self.proc = None
                return Row(model_type, mappings, "timeout", f"no result in {timeout:.0f} s")
            line = stdout.readline()
            if not line:
                code = self.proc.wait()
                self.proc = None
                return Row(model_type, mappings, "error", f"worker exited with code {code}")
            if line.startswith(MARK):
                row = Row(**json.loads(line[len(MARK) :]))
                if _out_of_memory(row):
                    self.proc.wait()  # the worker exits after this row
                    self.proc = None
                return row

    def close(self) -> None:
        if self.proc is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait()
            self.proc = None


def timm_row(row: Row, timeout: float = 300.0) -> Row:
    """`row`, whose model needs timm, again in a timm worker of its own (from any process: sweep, tests)."""
    if not (TIMM_PACKAGES / "timm").is_dir():
        row.detail = "needs timm and torchvision (a timm vision tower): `bash scripts/install` fills .timm-packages"
        return row
    slot = _Slot(timm=True)
    try:
        return slot.run(row.model_type, row.mappings, timeout)
    finally:
        slot.close()


def _out_of_memory(row: Row) -> bool:
    return "allocate" in row.detail or "MemoryError" in row.detail


def sweep(types: dict[str, list[str]], workers: int, timeout: float) -> list[Row]:
    """Rows of every type in `types`, `workers` processes at a time."""
    todo = list(types.items())
    rows: list[Row] = []
    lock = threading.Lock()

    def drain() -> None:
        slot = _Slot()
        while True:
            with lock:
                if not todo:
                    break
                model_type, mappings = todo.pop(0)
            row = slot.run(model_type, mappings, timeout)
            with lock:
                rows.append(row)
                print(f"{len(rows)}/{len(types)} {row.model_type}: {row.status} {row.detail}", file=sys.stderr)
        slot.close()

    threads = [threading.Thread(target=drain) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(rows, key=lambda r: r.model_type)
