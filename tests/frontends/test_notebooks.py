"""The notebooks run as committed in a real Jupyter kernel (nbclient), and are committed stripped of outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the notebook tests need the jupyter extra")
NotebookClient = pytest.importorskip("nbclient", reason="the notebook tests need the jupyter extra").NotebookClient

ROOT = Path(__file__).parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _outputs(notebook: nbformat.NotebookNode) -> list[dict[str, object]]:
    return [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.get("outputs", [])]


def test_notebooks_are_committed_stripped() -> None:
    """No cell carries stored output or an execution count (nbstripout --verify agrees)."""
    for path in NOTEBOOKS:
        code = [cell for cell in json.loads(path.read_text())["cells"] if cell["cell_type"] == "code"]
        assert all(not cell.get("outputs") and cell.get("execution_count") is None for cell in code), path.name
    proc = subprocess.run(
        [sys.executable, "-m", "nbstripout", "--verify", *map(str, NOTEBOOKS)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_in_a_kernel(path: Path) -> None:
    """Every cell executes in order without error; the store shows as HTML, the explorer draws its plots, cached answers equal cold ones."""
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = _outputs(notebook)
    errors = [out for out in outputs if out.get("output_type") == "error"]
    assert not errors, errors
    html = [out["data"]["text/html"] for out in outputs if "text/html" in out.get("data", {})]
    assert any("hit rate" not in h and "prompt tokens reused" in h for h in html), "the store renders as HTML"
    text = "".join(str(out.get("text", "")) for out in outputs)
    if path.name == "quickstart.ipynb":
        assert text.count("same=True") == 3 and "same=False" not in text
    else:
        assert text.count("identical to cold: True") == 7 and "identical to cold: False" not in text
        pngs = [out for out in outputs if "image/png" in out.get("data", {})]
        assert len(pngs) == 3  # the time-to-first-token plot and two radix trees
        assert "'image': 16" in text  # the second image turn reuses the first image
