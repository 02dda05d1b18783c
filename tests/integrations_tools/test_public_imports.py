"""The examples in integrations/ use the package as a user would: only the names of `hf_prefix_cache.__all__`."""

from __future__ import annotations

import ast

import hf_prefix_cache
from integrations_tools.examples import ROOT

EXAMPLES = sorted((ROOT / "integrations").glob("*/*.py"))


def _package_imports(tree: ast.Module) -> list[tuple[str, str]]:
    """Each `(module, name)` the script imports from the package (`name` "" for a plain ``import``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hf_prefix_cache":
            found += [(node.module or "", alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names if alias.name.split(".")[0] == "hf_prefix_cache"]
    return found


def test_every_example_imports_only_public_names() -> None:
    assert len(EXAMPLES) >= 5, EXAMPLES
    for path in EXAMPLES:
        for module, name in _package_imports(ast.parse(path.read_text())):  # the openai client imports none
            assert module == "hf_prefix_cache" and name in hf_prefix_cache.__all__, (
                path.relative_to(ROOT),
                module,
                name,
            )
