"""Gemma 3n's media tests pass in `.venv-timm`, the venv with timm and torchvision that `scripts/install` makes.

Gemma 3n's vision tower is a timm model, and timm imports torchvision, which does not import beside
the main environment's CPU torch; so `tests/media/test_media_gemma3n.py` skips here and this test runs it
in the venv, on this checkout (`PYTHONPATH`), requiring every test to pass and none to skip.
Without the venv it skips, except in CI (`CI` set), where a missing venv fails.
"""

from __future__ import annotations

import os
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = ROOT / ".venv-timm" / "bin" / "python"
TESTS = "tests/media/test_media_gemma3n.py"


def test_gemma3n_media_tests_pass_in_the_timm_venv(tmp_path: Path) -> None:
    """Every Gemma 3n media test runs in `.venv-timm` and passes: none fails, errs or skips."""
    if not VENV_PYTHON.exists():
        if os.environ.get("CI"):
            pytest.fail(".venv-timm is missing: `bash scripts/install` makes it, and CI must run the Gemma 3n tests")
        pytest.skip(".venv-timm is missing: run `bash scripts/install` to make it and run the Gemma 3n media tests")
    report = tmp_path / "report.xml"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [str(VENV_PYTHON), "-m", "pytest", TESTS, "-p", "no:cacheprovider", f"--junitxml={report}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    log = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, f"{TESTS} failed in .venv-timm (exit {done.returncode}):\n{log}"
    root = ET.parse(report).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    assert suite is not None, log
    counts = {name: int(suite.get(name, "0")) for name in ("tests", "failures", "errors", "skipped")}
    assert counts["tests"] >= 12 and counts["failures"] == counts["errors"] == counts["skipped"] == 0, (counts, log)
