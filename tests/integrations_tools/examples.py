"""Helpers of the integration tests: load an example script of integrations/ by path; skip, saying what to install, when its tool is missing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What bash scripts/install runs for these tools (langchain-huggingface caps huggingface_hub below 2, hence --no-deps).
INSTALL = "pip install -e '.[integrations]' && pip install --no-deps 'langchain-huggingface>=1.2,<2'"


def short_handbook() -> str:
    """The handbook's first five sections (about 560 tokens): a long shared prefix that costs half the full one's prefill."""
    from hf_prefix_cache import HANDBOOK

    return "\n\n".join(HANDBOOK.split("\n\n")[:6])


def require(*modules: str, install: str = INSTALL) -> None:
    """Skip the calling test module unless every module imports, with the install command as the reason."""
    for name in modules:
        pytest.importorskip(name, reason=f"{name} is not installed here: {install}")


def smollm2_dir() -> str:
    """The local SmolLM2-135M-Instruct folder, or a skip naming what to install."""
    from hf_prefix_cache import ModelUnavailableError, smollm2_folder

    try:
        return str(smollm2_folder())
    except ModelUnavailableError as exc:
        pytest.skip(f"SmolLM2 is not available here: {exc}")


def example(relative: str) -> ModuleType:
    """Import `integrations/<relative>` as a module (the examples are scripts, not a package)."""
    path = ROOT / "integrations" / relative
    spec = importlib.util.spec_from_file_location(f"integrations_{path.parent.name}_{path.stem}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module
