"""The canary's areas (`scripts/canary`): one pytest run of chosen tests, then PASS / FAIL / SKIP per area.

Each area names the tests that stand for it (pytest node ids; a file stands for all its tests). Every
test compares cached with cold runs (tokens, logits within 1e-4) and counts hits, so an area that
fails names what the new release broke: a cache layer type, a media kind, a decoding mode, an
encoder-decoder family, serving, or only the declared version range. One pytest process runs them
all (its start-up, not the tests, is most of the time), with one torch thread; `serve --help` runs
after it (the serve area's request needs the real model's files, `hf_prefix_cache.api.models`).
Run by `scripts/canary` with the canary environment's Python, from the repository root.

Usage::

    .venv-canary/bin/python scripts/canary_areas.py [LOG_DIR]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

_E = "tests/hooks/test_exactness.py::test_multi_turn_chat_reuses_prompt_and_answer"
_D = "tests/hooks/test_decoding_modes.py::test_a_decoding_mode_reuses_the_stored_prefix_exactly"
_IMAGE = "tests/media/test_media_exactness.py::test_second_image_in_the_suffix"

#: Area -> the tests that stand for it.
AREAS: dict[str, tuple[str, ...]] = {
    "full attention": (f"{_E}[llama]", f"{_E}[gpt2]"),
    "sliding window": (
        f"{_E}[mistral]",
        "tests/model/test_sliding_window.py::"
        "test_windowed_layers_restore_exactly_at_prompt_answer_and_divergence_points[gemma3_text]",
    ),
    "chunked attention": (f"{_E}[llama4_text]",),
    "indexed attention": (
        f"{_E}[deepseek_v32]",
        "tests/hooks/test_indexer_top_k.py::test_prompts_several_times_the_top_k_reuse_exactly[glm_moe_dsa]",
    ),
    "recurrent": (
        f"{_E}[mamba2]",
        "tests/model/test_recurrent.py::test_a_continued_scan_equals_the_models_own_one_token_steps[mamba]",
    ),
    "hybrid": (f"{_E}[qwen3_next]", f"{_E}[jamba]", f"{_E}[lfm2]", f"{_E}[falcon_h1]"),
    "compressed attention": (
        "tests/model/test_compressed_attention.py::test_a_second_turn_and_a_repeat_reuse_the_stored_prompt_exactly",
    ),
    "media: image": (f"{_IMAGE}[llava]", f"{_IMAGE}[qwen2_vl]"),
    "media: audio": ("tests/media/test_media_generic.py::test_second_medium_in_the_suffix[voxtral]",),
    "media: video": (
        "tests/media/test_media_qwen3_video_prompt.py",
        "tests/media/test_media_qwen_video_omni.py::test_qwen3_vl_chat_with_a_video_in_a_later_turn",
    ),
    "padded batch": (
        "tests/hooks/test_batches.py::test_a_left_padded_batch_restores_each_rows_own_prefix[greedy-llama]",
    ),
    "beam search": (f"{_D}[beams-llama]",),
    "sampling, several sequences": (f"{_D}[samples-llama]",),
    "assisted decoding": (f"{_D}[assistant_model-llama]",),
    "static cache": (f"{_D}[static_cache-llama]",),
    "whisper": (
        "tests/hooks/test_whisper.py::test_exact_repeat_reuses_the_decoder_prefix_and_skips_the_encoder[en-transcribe]",
    ),
    "encoder-decoder": (
        "tests/hooks/test_seq2seq.py::test_an_exact_repeat_reuses_the_decoder_prefix_and_skips_the_encoder[bart]",
    ),
    "new model types (5.25)": ("tests/hooks/test_models_525.py",),
    # A real server (SmolLM2) and transformers serve side by side: one two-turn chat, equal answers, hits.
    "serve: a request": (
        "tests/frontends/test_serve.py::test_each_turn_reuses_the_previous_one_and_equals_transformers_serve[json]",
    ),
    "declared version range": ("tests/api/test_compat.py::test_the_installed_release_is_one_we_tested",),
}


def _results(junit: Path) -> dict[str, tuple[str, str]]:
    """Node id -> (outcome, first line of its message) from pytest's JUnit XML."""
    out: dict[str, tuple[str, str]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        # A module skipped or failing at collection is a case named by its module, with no class name.
        node = classname.replace(".", "/") + ".py::" + name if classname else name.replace(".", "/") + ".py"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = (
                    "failed" if tag != "skipped" else "xfailed" if found.get("type") == "pytest.xfail" else "skipped"
                )
                text = found.get("message") or ""
                if text in ("", "collection skipped", "collection failure"):
                    text = f"{text} {found.text or ''}".strip()
                # Its first two lines, each cut short: an exception's own first line may be a long command.
                lines = [line.strip()[:110] for line in text.splitlines() if line.strip()] or [tag]
                message = " | ".join(lines[:2])
                break
        out[node] = (outcome, message)
    return out


def _area(selection: tuple[str, ...], results: dict[str, tuple[str, str]]) -> tuple[str, str]:
    """An area's status and the detail printed under it (the first failure, or why it skipped)."""
    mine = {n: r for n, r in results.items() if any(n == s or n.startswith(s + "::") for s in selection)}
    failed = [(n, m) for n, (o, m) in mine.items() if o == "failed"]
    passed = sum(o == "passed" for o, _ in mine.values())  # an expected failure (xfail) neither passes nor fails
    if not mine:
        return "FAIL", "no test ran (renamed or not collected: see the log)"
    if failed:
        node, message = failed[0]
        return "FAIL", f"{len(failed)} of {len(mine)} failed; first: {node.split('::')[-1]}: {message}"
    if not passed:
        return "SKIP", next(m for _, m in mine.values())
    others = [o for o, _ in mine.values() if o != "passed"]
    return "PASS", ", ".join([f"{passed} passed"] + [f"{others.count(o)} {o}" for o in sorted(set(others))])


def main(argv: list[str]) -> int:
    logs = Path(argv[1]) if len(argv) > 1 else Path(tempfile.mkdtemp(prefix="canary."))
    logs.mkdir(parents=True, exist_ok=True)
    junit = logs / "junit.xml"
    ids = list(dict.fromkeys(i for selection in AREAS.values() for i in selection))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    with (logs / "pytest.log").open("w") as log:
        args = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rfEs", f"--junitxml={junit}", *ids]
        subprocess.run(args, stdout=log, stderr=subprocess.STDOUT, env=env, check=False)
    took = time.perf_counter() - started
    results = _results(junit) if junit.is_file() else {}
    rows = [(name, *_area(selection, results)) for name, selection in AREAS.items()]
    # serve: its command line parses its arguments and prints its help (no server is started here).
    help_run = subprocess.run(
        [sys.executable, "-m", "hf_prefix_cache", "serve", "--help"], capture_output=True, text=True, check=False
    )
    (logs / "serve_help.log").write_text(help_run.stdout + help_run.stderr)
    last = (help_run.stderr.strip().splitlines() or ["no output"])[-1]
    rows.append(
        (
            "serve --help",
            "PASS" if help_run.returncode == 0 else "FAIL",
            "usage printed" if not help_run.returncode else last,
        )
    )
    for name, status, detail in rows:
        print(f"{status:4s} {name:28s} {detail}")
    counts = {s: sum(r[1] == s for r in rows) for s in ("PASS", "FAIL", "SKIP")}
    print(
        f"\n{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped of {len(rows)} areas; "
        f"{len(results)} tests in {took:.0f} s; logs in {logs}"
    )
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
