"""A hit adds at most 2 launching ops per layer + 20 and 1 host sync over a ready DynamicCache before the prefill."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_ops import count_hit  # noqa: E402


@pytest.mark.parametrize("kind", ["text", "vlm", "hybrid"])
@pytest.mark.parametrize("num_layers", [16, 80])
def test_a_hit_costs_constant_work_before_the_prefill(kind: str, num_layers: int) -> None:
    """The restore and bookkeeping of a 200-token hit stay within budget, however many parameters the model has."""
    ops = count_hit(kind, num_layers)
    assert ops.hit_len == 200, f"the counted call should reuse the stored prefix, reused {ops.hit_len}"
    assert ops.within_budget, (
        f"{kind} x{num_layers}: {ops.launches['before']} extra launches (budget {ops.budget}), "
        f"{ops.syncs['before']} extra syncs before the prefill; largest {ops.largest}"
    )
    # Only a hybrid's prompt-end snapshot costs a forward more (prompt_snapshot=True, the default).
    assert ops.extra_forwards == (1 if kind == "hybrid" else 0)


def test_a_hybrid_without_prompt_snapshots_runs_no_extra_forward() -> None:
    """With prompt_snapshot=False a hybrid's hit feeds its suffix in generate's own forward: no split prefill."""
    ops = count_hit("hybrid", 16, prompt_snapshot=False)
    assert ops.hit_len == 200
    assert ops.extra_forwards == 0
    assert ops.launches["forward"] == 0
    assert ops.within_budget


@pytest.mark.parametrize("num_layers", [16, 80])
def test_a_prefix_in_two_runs_is_not_joined_before_the_prefill(num_layers: int) -> None:
    """A stored prefix in two runs costs what one run costs before the prefill; each layer joins it in its forward
    with one small concatenation of keys and one of values."""
    ops = count_hit("text", num_layers, branch=True)
    one_run = count_hit("text", num_layers)
    assert ops.hit_len == 200
    assert ops.within_budget
    assert ops.launches["before"] <= one_run.launches["before"] + 1  # a NaN stand-in for the layers until first use
    assert ops.launches["forward"] <= 2 * num_layers
