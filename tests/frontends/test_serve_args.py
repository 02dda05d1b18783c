"""`hf-prefix-cache serve`'s options (`frontends/serve_args.py`): parsed before the server is imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hf_prefix_cache._compat import serve_requirement
from hf_prefix_cache.frontends.serve_args import (
    CPU_LINEAR_CHOICES,
    DEFAULT_TENANT,
    build_parser,
    read_keys,
    served_model_name,
)


def test_serve_help_imports_no_server() -> None:
    """``serve --help`` answers from the parser alone: neither torch, transformers, the server (FastAPI, uvicorn) nor
    our app is imported."""
    code = (
        "import sys\nfrom hf_prefix_cache.frontends.cli import main\ntry:\n    main(['serve', '--help'])\n"
        "except SystemExit as exc:\n    assert exc.code == 0\n"
        "heavy = ('torch', 'transformers', 'fastapi', 'uvicorn', 'hf_prefix_cache.frontends.serve')\n"
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    root = Path(__file__).parents[2]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, check=True)
    assert "--api-keys-file" in done.stdout and "--max-queued" in done.stdout and "--served-model-name" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_keys_and_names(tmp_path: Path) -> None:
    """--api-key keys are tenant 'default', a keys file names its own; a bad file is refused naming it."""
    good = tmp_path / "keys.json"
    good.write_text(json.dumps({"k2": "acme"}))
    assert read_keys(["k1"], str(good)) == {"k1": DEFAULT_TENANT, "k2": "acme"}
    bad = tmp_path / "bad.json"
    bad.write_text('["k1"]')
    with pytest.raises(SystemExit, match="bad.json must be a JSON object"):
        read_keys([], str(bad))
    with pytest.raises(SystemExit, match="cannot read --api-keys-file"):
        read_keys([], str(tmp_path / "missing.json"))
    assert served_model_name("smollm2", None) == "smollm2"
    assert served_model_name("/m/Qwen3-0.6B/", None) == "Qwen3-0.6B"
    assert served_model_name("/m/Qwen3-0.6B", "qwen") == "qwen"
    assert served_model_name("none", None) is None
    args = build_parser().parse_args([])
    assert (args.max_body_bytes, args.max_queued, args.request_timeout) == (32 * 2**20, 64, 600.0)


def test_batching_is_on_unless_no_batch() -> None:
    """Requests decode together by default; ``--no-batch`` serves one at a time; ``--max-batch-rows`` bounds a batch."""
    assert build_parser().parse_args([]).batch is True
    args = build_parser().parse_args(["--no-batch", "--max-batch-rows", "4"])
    assert args.batch is False and args.max_batch_rows == 4


def test_cpu_linear_is_auto_unless_named() -> None:
    """``--cpu-linear`` offers `batching.cpu_linear`'s choices, ``auto`` by default; another is refused."""
    from hf_prefix_cache.batching.cpu_linear import CHOICES

    assert CPU_LINEAR_CHOICES == CHOICES
    assert build_parser().parse_args([]).cpu_linear == "auto"
    assert build_parser().parse_args(["--cpu-linear", "onednn"]).cpu_linear == "onednn"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--cpu-linear", "mkl"])


@pytest.mark.skipif(serve_requirement() is not None, reason=str(serve_requirement()))
def test_cpu_linear_reaches_the_models_loader() -> None:
    """The kernel named on the command line is the one each model's process applies (`StoreLoader`)."""
    from hf_prefix_cache.frontends.serve import options_from

    options = options_from(build_parser().parse_args(["--cpu-linear", "prepacked"]))
    assert options.cpu_linear == "prepacked" and options.loader().cpu_linear == "prepacked"
