"""The wheel: built with the standard build tool, installed in a new venv, it imports and runs the tiny demo and chat.

The sources (`pyproject.toml`, `README.md`, the package) are copied to a temporary folder and built
there with `python -m build --wheel --no-isolation`, so the checkout gets no `build/` folder and
two suites running side by side do not race. The wheel goes into a new venv with ``--no-deps``;
the venv reaches the test environment's packages (torch, transformers, ...) through a `.pth` line
placed after its own site-packages, so the package that imports is the wheel's copy. Then the
venv's `hf-prefix-cache` console script runs ``demo --tiny`` and a piped ``chat --tiny``.
Runs once per suite: on the newest tested transformers only (the wheel does not depend on it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import transformers

from hf_prefix_cache import _compat

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not transformers.__version__.startswith(_compat.NEWEST_TESTED + "."),
    reason="the wheel test runs once per suite, on the newest tested transformers",
)


def _run(command: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(command)} exited {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}"
    return done


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the built wheel, the bin folder of a new venv with it installed)."""
    pytest.importorskip("build", reason="the wheel test needs the build tool: pip install build (the [dev] extra)")
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "hf_prefix_cache", source / "hf_prefix_cache", ignore=shutil.ignore_patterns("__pycache__"))
    _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(work / "dist")], cwd=source)
    (wheel,) = (work / "dist").glob("hf_prefix_cache-*.whl")
    venv = work / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=work)
    python = venv / "bin" / "python"
    own = Path(
        _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], work).stdout.strip()
    )
    parent = sysconfig.get_paths()["purelib"]
    (own / "zz_test_environment.pth").write_text(f"import site; site.addsitedir({parent!r})\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)], cwd=work)
    return wheel, venv / "bin"


def test_the_wheel_holds_the_package_and_its_command(wheel_venv: tuple[Path, Path]) -> None:
    wheel, _ = wheel_venv
    names = zipfile.ZipFile(wheel).namelist()
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "hf_prefix_cache").rglob("*.py")}
    assert sources <= set(names), sorted(sources - set(names))[:5]
    assert "hf_prefix_cache/py.typed" in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "hf-prefix-cache = hf_prefix_cache.frontends.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_the_venv_imports_the_wheels_copy(wheel_venv: tuple[Path, Path]) -> None:
    _, bin_dir = wheel_venv
    done = _run([str(bin_dir / "python"), "-c", "import hf_prefix_cache as p; print(p.__file__)"], cwd=bin_dir)
    where = Path(done.stdout.strip())
    assert bin_dir.parent in where.parents, f"imported {where}, not the wheel's copy in {bin_dir.parent}"


def test_the_installed_command_runs_the_tiny_demo_and_chat(wheel_venv: tuple[Path, Path]) -> None:
    _, bin_dir = wheel_venv
    command = str(bin_dir / "hf-prefix-cache")
    demo = _run(
        [command, "demo", "--tiny", "--layers", "2", "--hidden", "64", "--system-tokens", "100", "--repeats", "1"],
        bin_dir,
    )
    assert "reused" in demo.stdout and "False" not in demo.stdout
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    chat = subprocess.run(
        [command, "chat", "--tiny", "--compare-cold", "--max-new-tokens", "3"],
        input="Hello\nAgain\n",
        cwd=bin_dir,
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert chat.returncode == 0, chat.stderr[-3000:]
    assert chat.stdout.count("identical to cold: yes") == 2
