"""docs/structure.md's module table is generated from the code and must be current."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_module_table_is_current() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "structure.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_every_module_says_its_job() -> None:
    text = (ROOT / "docs" / "structure.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) == len(list((ROOT / "hf_prefix_cache").rglob("*.py")))
    empty = [row.split("|")[1].strip() for row in rows if not row.split("|")[2].strip()]
    assert not empty, f"modules without a docstring: {empty}"
