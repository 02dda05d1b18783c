"""The quick-start demo runs the real model when it loads, and says why and falls back to the tiny one when not."""

from __future__ import annotations

import re

import pytest

from hf_prefix_cache.frontends import demo


def test_demo_on_the_real_model_prints_answers_and_first_token_times(capsys: pytest.CaptureFixture[str]) -> None:
    """Each request line shows prompt, reused tokens and both times; answers are printed; cached equals cold."""
    demo.main(["--new-tokens", "3"])
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct" in out
    assert out.count("    A: ") == 7  # three questions, four chat turns
    assert "every cached answer equals its cold run" in out
    rows = [
        re.match(r"(question|chat turn) \d+\s+(\d+)\s+(\d+)\s+\S+\s+\S+\s+(.+)$", line) for line in out.splitlines()
    ]
    rows = [row for row in rows if row is not None]
    assert len(rows) == 7
    reused = [int(row[3]) for row in rows]
    assert reused[0] == 0 and all(r > 1000 for r in reused[1:])
    # A speedup is shown only where tokens were reused; the first request says why it has none.
    assert rows[0][4].strip() == "none (nothing stored matched)"
    assert all(re.fullmatch(r"\d+\.\dx", row[4].strip()) for row in rows[1:])
    assert "WARNING" not in out


def test_demo_falls_back_to_the_tiny_model_with_the_reason(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no usable place to convert the real model into, the demo names the problem and runs the tiny model."""
    monkeypatch.setenv("HF_PREFIX_CACHE_HOME", "/proc/no-such-dir")
    demo.main(["--layers", "2", "--hidden", "64", "--system-tokens", "200", "--new-tokens", "4"])
    out = capsys.readouterr().out
    assert "The real model cannot be loaded here (cannot write the converted model under /proc/no-such-dir" in out
    assert "tiny Llama" in out and "True" in out and "False" not in out


def test_a_demo_run_that_reuses_nothing_says_so_and_claims_no_speedup(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that stores nothing (every sequence below its minimum length): no row claims a speedup, a warning ends the run."""
    original = demo.PrefixCache
    monkeypatch.setattr(demo, "PrefixCache", lambda model: original(model, min_store_len=10_000))
    demo.run_tiny(demo.argparse.Namespace(layers=2, hidden=64, system_tokens=40, new_tokens=2))
    out = capsys.readouterr().out
    rows = [
        line for line in out.splitlines() if line.startswith(("system prompt", "chat turn", "new question", "the same"))
    ]
    assert rows and all("none (" in line and not re.search(r"\d\.\dx", line) for line in rows)
    assert "WARNING: the store reused no token in this run" in out
