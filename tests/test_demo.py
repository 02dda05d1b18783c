"""The quick-start demo runs the real model when it loads, and says why and falls back to the tiny one when not."""

from __future__ import annotations

import pytest

from hf_prefix_cache.frontends import demo


def test_demo_on_the_real_model_prints_answers_and_first_token_times(capsys: pytest.CaptureFixture[str]) -> None:
    """Each request line shows prompt, reused tokens and both times; answers are printed; cached equals cold."""
    demo.main(["--new-tokens", "3"])
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct" in out
    assert out.count("    A: ") == 7  # three questions, four chat turns
    assert "every cached answer equals its cold run" in out
    rows = [line.split() for line in out.splitlines() if line.startswith(("question", "chat turn"))]
    assert len(rows) == 7
    reused = [int(row[-4]) for row in rows]
    assert reused[0] == 0 and all(r > 1000 for r in reused[1:])


def test_demo_falls_back_to_the_tiny_model_with_the_reason(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no usable place to convert the real model into, the demo names the problem and runs the tiny model."""
    monkeypatch.setenv("HF_PREFIX_CACHE_HOME", "/proc/no-such-dir")
    demo.main(["--layers", "2", "--hidden", "64", "--system-tokens", "200", "--new-tokens", "4"])
    out = capsys.readouterr().out
    assert "The real model cannot be loaded here (cannot write the converted model under /proc/no-such-dir" in out
    assert "tiny Llama" in out and "True" in out and "False" not in out
