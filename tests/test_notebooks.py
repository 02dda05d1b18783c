"""The notebooks run as committed, and are committed without outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_and_has_no_outputs(path: Path) -> None:
    """Every code cell executes in order, and no cell carries stored output."""
    notebook = json.loads(path.read_text())
    code = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    assert all(not cell.get("outputs") and cell.get("execution_count") is None for cell in code)
    namespace: dict[str, object] = {}
    for cell in code:
        exec(compile("".join(cell["source"]), str(path), "exec"), namespace)  # noqa: S102 - our own notebook
