"""docs/serving.md's Python example (a store attached to every call, a `store.request` block) runs as pasted."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from hf_prefix_cache.errors import ModelUnavailableError

ROOT = Path(__file__).resolve().parents[2]


def test_the_request_scope_example_runs_as_pasted_and_reuses_the_prompt() -> None:
    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "docs" / "serving.md").read_text(), flags=re.S | re.M)
    (block,) = [b for b in blocks if "store.request(" in b]
    namespace: dict[str, object] = {"__name__": "__serving__"}
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(block, "docs/serving.md", "exec"), namespace)
    except ModelUnavailableError as exc:
        pytest.skip(f"the real model cannot be loaded here: {exc}")
    prompt_len = namespace["inputs"]["input_ids"].shape[1]  # type: ignore[index]
    assert out.getvalue().split() == ["0", str(prompt_len - 1)]
