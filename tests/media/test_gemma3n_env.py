"""The timm-tower media tests pass with timm and torchvision from `.timm-packages`, on this interpreter's transformers.

Gemma 3n's vision tower is a timm model (as are FastVLM's and Perception LM's, in
`tests/media/test_media_timm_towers.py`), and timm imports torchvision. `scripts/install` puts both
in `.timm-packages` (``--no-deps``, beside the CPU torch); PyPI's torchvision cannot load its C++
ops there, so the plugin `tests/support/torchvision_ops.py` declares the two op schemas its import
needs. Only these tests see them: with timm importable everywhere, transformers would pick
other image processors and `docs/support.md` would depend on the machine. So
`tests/media/test_media_gemma3n.py` (and the timm-tower file) skips in the suite itself and this test runs it in a child
interpreter (the same Python, so each transformers release runs it), requiring every test to pass
and none to skip. Without the folder it skips, except in CI (`CI` set), where it fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ROOT / ".timm-packages"
#: The test files that need timm, and how many tests each has at least.
TIMM_TESTS = {"tests/media/test_media_gemma3n.py": 12, "tests/media/test_media_timm_towers.py": 9}


@pytest.mark.parametrize("tests", list(TIMM_TESTS))
def test_timm_tower_media_tests_pass_with_the_timm_packages(tmp_path: Path, tests: str) -> None:
    """Every test of `tests` runs with `.timm-packages` on the path and passes: none fails, errs or skips."""
    if not (PACKAGES / "timm").is_dir():
        if os.environ.get("CI"):
            pytest.fail(
                ".timm-packages is missing: `bash scripts/install` fills it, and CI must run the Gemma 3n tests"
            )
        pytest.skip(".timm-packages is missing: run `bash scripts/install` to fill it and run the Gemma 3n media tests")
    report = tmp_path / "report.xml"
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), str(PACKAGES)])
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            tests,
            "-p",
            "no:cacheprovider",
            "-p",
            "support.torchvision_ops",
            f"--junitxml={report}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    log = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, f"{tests} failed with .timm-packages (exit {done.returncode}):\n{log}"
    root = ET.parse(report).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    assert suite is not None, log
    counts = {name: int(suite.get(name, "0")) for name in ("tests", "failures", "errors", "skipped")}
    assert counts["tests"] >= TIMM_TESTS[tests] and counts["failures"] == counts["errors"] == counts["skipped"] == 0, (
        counts,
        log,
    )
