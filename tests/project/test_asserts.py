"""No `assert` stands between stored states and an answer: ``python -O`` removes every one (#43).

The exactness guards raise `errors.InconsistentStateError` (listed in docs/fallbacks.md, "Exactness
guards"), which the request path turns into a cold run. An `assert` may stay in the package only as a
type narrowing (`assert x is not None`, `assert isinstance(x, T)`: the line after it would fail without
it, under ``-O`` too) or as one of the programming-error checks budgeted per module below, each one
where no wrong answer can follow (a caller's misuse of an internal verb, a registration made twice).
`hf_prefix_cache/testing/` is test code, not the package's path, and is left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hf_prefix_cache"

#: Programming-error asserts allowed per module (not narrowings): each guards a caller's misuse, never states.
BUDGET = {
    "frontends/serve/app.py": 1,  # continuous batching is off in this server
    "hooks/patching.py": 1,  # a family registered twice
    "hooks/seq2seq.py": 1,  # one request reaches the inner step once
    "model/layers/recurrent.py": 1,  # a join of no rows
    "model/static.py": 1,  # to_static on a model whose layers have no static form (the hook checks first)
    "model/working_cache.py": 4,  # landing and item verbs on models the profile says cannot take them
    "multimodal/generic.py": 2,  # a family declaring what it cannot do
    "multimodal/qwen_vl.py": 1,  # the same
    "multimodal/registry.py": 2,  # a media family registered without a model type or with two adapters
    "storage/disk.py": 3,  # a tier verb given a segment on disk, stubs that disagree with their file's ref count
    "storage/mover.py": 2,  # a disk segment handed to a copy between memory tiers
    "storage/segments.py": 1,  # a join of no pieces
    "storage/tier.py": 1,  # a standalone place asked to load a disk segment
    "store/disk_nodes.py": 1,  # the nodes sharing a file disagree with its ref count (bookkeeping)
    "store/node_place.py": 1,  # the root asked for its segment
    "store/placement.py": 2,  # tier and budget lists of different lengths, a move to a faster tier
    "store/prefixes.py": 1,  # item states on a model with recurrent states (the hook never asks)
    "tree/radix.py": 5,  # tier indices, lock counts, removing a locked or inner node
}


def _is_narrowing(test: ast.expr) -> bool:
    """`x is not None`, `isinstance(...)`, or several of them joined by `and`."""
    if isinstance(test, ast.BoolOp) and isinstance(test.op, ast.And):
        return all(_is_narrowing(v) for v in test.values)
    if isinstance(test, ast.Compare):
        return (
            len(test.ops) == 1
            and isinstance(test.ops[0], ast.IsNot)
            and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value is None
        )
    return isinstance(test, ast.Call) and isinstance(test.func, ast.Name) and test.func.id == "isinstance"


def _checks(path: Path) -> list[int]:
    """The lines of `path`'s asserts that are not narrowings."""
    tree = ast.parse(path.read_text(), str(path))
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assert) and not _is_narrowing(n.test)]


def _modules() -> dict[str, list[int]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if not name.startswith("testing/"):
            found[name] = _checks(path)
    return found


def test_no_module_asserts_more_than_its_budget_of_programming_error_checks() -> None:
    """Guards are raises; an assert beyond a module's budget must become one (or the budget names why not)."""
    modules = _modules()
    over = {name: lines for name, lines in modules.items() if len(lines) > BUDGET.get(name, 0)}
    assert not over, f"asserts that are not narrowings, over budget (make them raise InconsistentStateError): {over}"
    assert set(BUDGET) <= set(modules), set(BUDGET) - set(modules)


def test_the_narrowing_test_tells_them_apart() -> None:
    narrowing = ["assert x is not None", "assert a is not None and isinstance(b, int)", "assert isinstance(x, T)"]
    checks = ["assert x == 1", "assert x is None", "assert a is not None and n < 3", "assert not x"]
    assert all(_is_narrowing(ast.parse(s).body[0].test) for s in narrowing)  # type: ignore[attr-defined]
    assert not any(_is_narrowing(ast.parse(s).body[0].test) for s in checks)  # type: ignore[attr-defined]
