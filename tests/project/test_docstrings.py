"""Every docstring example in the package runs, so documentation cannot drift from the code.

Each module's examples run with a few names bound, as a reader would have them: `torch`, a
tiny random-weight Llama `model`, a fresh `store = PrefixCache(model)` and a prompt `ids`.
Examples that need what a test machine lacks (a browser, a server, a real checkpoint) say so
with ``# doctest: +SKIP``.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_prefix_cache
from hf_prefix_cache import PrefixCache

MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(hf_prefix_cache.__path__, "hf_prefix_cache.")
    if m.name != "hf_prefix_cache.__main__"
)


def _globs() -> dict[str, Any]:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None  # answers run to max_new_tokens, so lengths are known
    return {"torch": torch, "model": model, "store": PrefixCache(model), "ids": torch.arange(4, 40)[None]}


def test_every_module_is_collected() -> None:
    assert "hf_prefix_cache.store.tree_store" in MODULES and "hf_prefix_cache.hooks.pipeline" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    try:
        module = importlib.import_module(name)
    except ImportError as exc:  # a front end whose optional extra is not installed
        pytest.skip(f"{name} needs an optional extra: {exc}")
    tests = [t for t in doctest.DocTestFinder(exclude_empty=True).find(module, name) if t.examples]
    if not tests:
        return
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    globs = _globs()
    try:
        for test in tests:
            test.globs.update(globs)
            runner.run(test)
    finally:
        globs["store"].detach()
    assert runner.failures == 0, f"{runner.failures} docstring example(s) of {name} failed (see the output above)"
