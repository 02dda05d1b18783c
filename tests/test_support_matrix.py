"""docs/support.md is up to date for the families the suite covers, and names no wrong result.

The rows of the text families in `tiny_models.TINY_MODELS` and of the media families with an
adapter are regenerated here (each builds a tiny model and runs cold / hit / repeat against
cold runs) and compared with the committed document; a difference means the store's
behaviour changed and `scripts/support_matrix.py` must be rerun.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from tiny_models import TINY_MODELS

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import support_matrix  # noqa: E402

from hf_prefix_cache.multimodal import _ADAPTERS  # noqa: E402

DOC = support_matrix.DOC.read_text()
ROWS = support_matrix.parse(DOC)
SWEPT = support_matrix.model_types()
# Gemma 4 text: per-layer head sizes once made PrefixCache construction raise.
COVERED = sorted(t for t in {*TINY_MODELS, *_ADAPTERS, "gemma4_text"} if t in SWEPT)


def test_generated_for_the_installed_transformers() -> None:
    assert f"against transformers {transformers.__version__};" in DOC


def test_every_swept_type_has_a_row() -> None:
    assert sorted(ROWS) == sorted(SWEPT)


def test_no_row_is_wrong() -> None:
    wrong = [line for line in ROWS.values() if "| WRONG |" in line]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("model_type", COVERED)
def test_row_is_up_to_date(model_type: str) -> None:
    row = support_matrix.run_row(model_type, SWEPT[model_type])
    assert ROWS[model_type] == row.line(), "rerun scripts/support_matrix.py --only " + model_type


@pytest.mark.parametrize(
    ("model_type", "reason"),
    [
        # No `past_key_values` in forward: a cache passed to generate was rejected as an unused kwarg.
        ("openai-gpt", "no_cache_argument"),
        # Full-causal masks over sliding-window cache layers: the output depends on how the prompt is chunked.
        ("moshi", "window_mask_mismatch"),
        # The cache holds the model's own prompt positions before the tokens: the store raised on insert.
        ("cpmant", "cache_longer_than_prompt"),
        ("xlm", "no_cache_argument"),
    ],
)
def test_found_by_the_sweep_runs_cold_with_its_reason(model_type: str, reason: str) -> None:
    row = support_matrix.run_row(model_type, SWEPT[model_type])
    assert (row.status, row.detail) == ("cold", f"`{reason}`")


@pytest.mark.parametrize("model_type", ["megatron-bert", "xlm-roberta-xl", "rembert"])
def test_bert_style_types_once_not_exact_are_served_as_decoders(model_type: str) -> None:
    """They were inexact only because the sweep built them bidirectional (no `is_decoder`); as decoders they are exact."""
    row = support_matrix.run_row(model_type, SWEPT[model_type])
    assert row.status == "served", row.line()


def test_the_whole_matrix_is_regenerated_and_agrees(tmp_path: Path) -> None:
    """CI generates docs/support.md anew, every row (about 2-3 min on 2 cores), and it must match the committed one.

    A row that times out here says nothing about the store (a loaded machine), so it is not
    compared; every other row must equal the committed line, and no row may be WRONG.
    """
    out = tmp_path / "support.md"
    script = Path(support_matrix.__file__)
    result = subprocess.run(
        [sys.executable, str(script), "--workers", "2", "--timeout", "120", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    fresh = support_matrix.parse(out.read_text())
    assert sorted(fresh) == sorted(ROWS)
    wrong = [line for line in fresh.values() if "| WRONG |" in line]
    assert not wrong, "\n".join(wrong)
    compared = [t for t in ROWS if "| timeout |" not in fresh[t] and "| timeout |" not in ROWS[t]]
    stale = [f"doc: {ROWS[t]}\nnow: {fresh[t]}" for t in compared if fresh[t] != ROWS[t]]
    assert not stale, "rerun scripts/support_matrix.py:\n" + "\n".join(stale)
    assert len(compared) >= len(ROWS) - 5, "too many rows timed out to call the matrix checked"


def test_a_config_without_a_readable_cache_layout_gives_a_cold_store_not_a_crash() -> None:
    """BLT in transformers 5.23: `DynamicCache(config=...)` raises reading its config, so its own
    `generate` fails; constructing a store for it once raised that AttributeError too."""
    from hf_prefix_cache import PrefixCache

    model = support_matrix.build("blt", "AutoModelForCausalLM")
    store = PrefixCache(model)
    assert store.profile.unsupported == "unreadable_cache_layout:AttributeError"
    row = support_matrix.run_row("blt", SWEPT["blt"])
    assert row.status == "error" and row.detail.startswith("cold generate: AttributeError"), row.line()
