"""MkDocs hooks (mkdocs.yml `hooks:`): files the site shows from outside docs/, without copying them there.

benchmarks/results/*.png are written by the benchmarks themselves; the site serves them as
images/benchmarks/<name> so a rerun of a benchmark needs no second copy kept in step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"


def on_files(files: Files, config: Any) -> Files:
    for png in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"images/benchmarks/{png.name}", abs_src_path=str(png)))
    return files
