"""docs/support.md is up to date for the families the suite covers, and names no wrong result.

The rows of the text families in `tiny_models.TINY_MODELS` and of the media families with an
adapter are regenerated here (each builds a tiny model and runs cold / hit / repeat against
cold runs, and, for a media family, cold / hit / changed medium / repeat with the suite's tiny
media model) and compared with the committed document; a difference means the store's
behaviour changed and `scripts/support_matrix.py` must be rerun.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import transformers

from hf_prefix_cache.testing.tiny_models import TINY_MODELS

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import support_inputs  # noqa: E402
import support_matrix  # noqa: E402
import support_media  # noqa: E402

from hf_prefix_cache import _compat  # noqa: E402
from hf_prefix_cache.multimodal import media, registry  # noqa: E402

DOC = support_matrix.DOC.read_text()
ROWS = support_matrix.parse(DOC)
SWEPT = support_matrix.model_types()
#: Types served by a hand-written adapter class (the generic table's are checked by the whole matrix).
HAND_WRITTEN = {key for key, row in registry.FAMILIES.items() if isinstance(row.adapter, type)}
# Gemma 4 text: per-layer head sizes once made PrefixCache construction raise.
COVERED = sorted(t for t in {*TINY_MODELS, *HAND_WRITTEN, "gemma4_text"} if t in SWEPT)
# The document describes the newest tested release; on the oldest (scripts/test's second run) its rows
# are regenerated and checked for wrong results, not compared line by line.
ON_DOC_RELEASE = f"against transformers {transformers.__version__};" in DOC
doc_release_only = pytest.mark.skipif(
    not ON_DOC_RELEASE,
    reason="docs/support.md describes the newest tested transformers; rows here are checked for WRONG only",
)


def test_generated_for_the_newest_tested_transformers() -> None:
    assert f"against transformers {_compat.NEWEST_TESTED}." in DOC


@doc_release_only
def test_every_swept_type_has_a_row() -> None:
    assert sorted(ROWS) == sorted(SWEPT)


def _wrong(rows: dict[str, str]) -> list[str]:
    return [line for line in rows.values() if support_matrix._row_from_line(line).is_wrong()]


def test_no_row_is_wrong() -> None:
    wrong = _wrong(ROWS)
    assert not wrong, "\n".join(wrong)


def test_every_adapter_family_has_a_media_case() -> None:
    """Each key the media registry serves has a media case (a timm tower's runs in the sweep's timm worker),
    and no other key does."""
    assert set(support_media.media_cases()) == set(registry.served())


def test_a_row_has_a_media_result_exactly_when_its_type_has_a_media_case() -> None:
    """The document's media cell is filled for every type with a case (one part per case), says why for a
    family named cold, and is empty otherwise."""
    for model_type, line in ROWS.items():
        cell = support_matrix._row_from_line(line).media
        keys = support_media.media_keys(model_type)
        if keys:
            assert len(cell.split("; ")) == len(keys), line
        elif model_type in registry.cold():
            assert cell.startswith("cold: "), line
        else:
            assert cell == "", line


def test_a_family_named_cold_has_its_reason_in_the_media_cell() -> None:
    """A type registered cold (`registry.cold()`) gets ``cold:`` and its reason, without running anything."""
    assert support_media.media_cell("minicpmv4_6", support_matrix.LOGIT_TOL).startswith("cold: 16x mode")
    assert support_media.media_status(support_media.media_cell("git", support_matrix.LOGIT_TOL)) == "cold"


def _content_blind_update(hasher: Any, part: Any) -> None:
    shape = part.size if hasattr(part, "getpixel") else tuple(part.shape)
    hasher.update(repr(shape).encode())


@pytest.mark.parametrize("key", ["llava", "qwen2_vl", "qwen2_5_omni_thinker", "mistral3"])
def test_a_content_blind_media_hash_makes_the_media_step_wrong(key: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With media keyed by shape only, medium B is served A's states: the changed-medium step reports WRONG."""
    monkeypatch.setattr(media, "_update", _content_blind_update)
    result = support_media.scenario(support_media.media_cases()[key](), support_matrix.LOGIT_TOL)
    assert result.status == "WRONG" and "changed" in result.detail, result


def test_a_changed_medium_hit_past_its_first_placeholder_is_wrong() -> None:
    """Reuse past medium A's first placeholder is WRONG even when the answer equals cold (here B is A again)."""
    case = support_media.media_cases()["qwen2_vl"]()
    same = dataclasses.replace(
        case, kwargs=lambda ids, names: case.kwargs(ids, ["a" if n == "b" else n for n in names])
    )
    result = support_media.scenario(same, support_matrix.LOGIT_TOL)
    assert result.status == "WRONG" and "past its first placeholder" in result.detail, result


@pytest.mark.parametrize("model_type", COVERED)
def test_row_is_up_to_date(model_type: str) -> None:
    row = support_matrix.run_row(model_type, SWEPT[model_type])
    assert not row.is_wrong(), row.line()
    if ON_DOC_RELEASE:
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
        # Drops the cached ids itself and masks by its own lengths (5.24 calls its argument `cache`).
        ("xlm", "slices_its_own_input"),
    ],
)
def test_found_by_the_sweep_runs_cold_with_its_reason(model_type: str, reason: str) -> None:
    row = support_matrix.run_row(model_type, SWEPT[model_type])
    assert (row.status, row.detail) == ("cold", f"`{reason}`")


@pytest.mark.parametrize(
    ("model_type", "reason"),
    [
        # Fed token ids, their encoders once failed on ids where they read features (Speech2Text),
        # a waveform (Moonshine) or patches (Pix2Struct); no family serves these encoder-decoders.
        ("speech_to_text", "encoder_decoder"),
        ("moonshine", "encoder_decoder"),
        ("pix2struct", "encoder_decoder"),
        # Its generate takes pixels first: once called with ids as pixels; it builds the prompt's embeddings itself.
        ("blip-2", "no_cache_argument"),
        # Needs its image and the mask of the image's positions: media without an adapter.
        ("kosmos-2", "media_inputs:kosmos-2"),
    ],
)
def test_a_type_fed_its_real_inputs_runs_cold_with_its_reason(model_type: str, reason: str) -> None:
    """Each once ended as `error` (generate failed on the sweep's inputs); fed features, pixels or
    placeholders, cold and cached runs agree and the store counts why it ran cold."""
    row = support_matrix.run_row(model_type, SWEPT[model_type])
    assert (row.status, row.detail) == ("cold", f"`{reason}`"), row.line()


def test_every_fed_type_is_a_swept_type_of_some_release() -> None:
    """A feed names a model type the sweep builds (on this release, or the newest, for types it lacks)."""
    unknown = sorted(t for t in support_inputs.FEEDS if t not in SWEPT and t not in ROWS)
    assert not unknown


@doc_release_only
def test_no_row_is_an_error_of_the_sweeps_inputs() -> None:
    """The only `error` rows left are transformers' own failures, whatever the inputs (BLT: its own
    `generate` reads a config attribute BltConfig lacks; VibeVoice: its generate's noise scheduler
    comes from `diffusers`, which the project does not install)."""
    errors = {t: line for t, line in ROWS.items() if support_matrix._row_from_line(line).status == "error"}
    assert sorted(errors) == ["blt", "vibevoice"], "\n".join(errors.values())


@pytest.mark.parametrize("model_type", ["megatron-bert", "xlm-roberta-xl", "rembert"])
def test_bert_style_types_once_not_exact_are_served_as_decoders(model_type: str) -> None:
    """They were inexact only because the sweep built them bidirectional (no `is_decoder`); as decoders they are exact."""
    row = support_matrix.run_row(model_type, SWEPT[model_type])
    assert row.status == "served", row.line()


@doc_release_only
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
    wrong = _wrong(fresh)
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
    assert store._store.profile.unsupported == "unreadable_cache_layout:AttributeError"
    row = support_matrix.run_row("blt", SWEPT["blt"])
    assert row.status == "error" and row.detail.startswith("cold generate: AttributeError"), row.line()
