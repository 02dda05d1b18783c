"""The hybrid and sliding-window exactness cases, and the guards' own tests, under ``python -O`` (asserts off).

``python -O`` removes every `assert`: what stands between a restore and a wrong answer must be real code
(`errors.InconsistentStateError`). A child interpreter run with ``-O`` refuses to start the tests if
`__debug__` is still true, then runs them; pytest rewrites the test modules' own asserts into code that
survives ``-O``, and `testing/compare.py` raises explicitly, so the comparisons still check.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from hf_prefix_cache.testing.tiny_models import HYBRID, SLIDING

ROOT = Path(__file__).resolve().parents[2]

# Run as `python -O -c _RUN <pytest args>`: exit 97 unless asserts are really off.
_RUN = """
import sys
import pytest
if __debug__:
    sys.exit(97)
sys.exit(pytest.main(sys.argv[1:]))
"""

EXACTNESS = "tests/hooks/test_exactness.py"


def test_hybrid_and_sliding_exactness_holds_with_asserts_off() -> None:
    """Every hybrid and sliding model's exactness scenarios, windowed sliding layers and the guards pass under -O."""
    # Each scenario of test_exactness.py (a test taking the `served` fixture) for each hybrid and sliding model.
    scenarios = re.findall(r"^def (test_\w+)\(served", (ROOT / EXACTNESS).read_text(), re.M)
    exactness = [f"{EXACTNESS}::{test}[{name}]" for test in scenarios for name in (*HYBRID, *SLIDING)]
    args = [
        *exactness,
        "tests/model/test_sliding_window.py::test_windowed_layers_restore_exactly_at_prompt_answer_and_divergence_points",
        "tests/hooks/test_guards.py",
        "-p",
        "no:cacheprovider",
        "-W",
        "ignore",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONOPTIMIZE", None)
    done = subprocess.run(
        [sys.executable, "-O", "-c", _RUN, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    out = done.stdout + done.stderr
    assert done.returncode != 97, "the child ran with asserts on"
    assert done.returncode == 0, out[-4000:]
    passed = re.search(r"(\d+) passed", out)
    assert scenarios and passed is not None and int(passed.group(1)) >= len(exactness) + len(SLIDING) + 5, out[-2000:]
    assert "failed" not in out, out[-2000:]
