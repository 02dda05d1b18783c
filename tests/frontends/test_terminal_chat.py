"""`hf-prefix-cache chat`: piped turns stream answers equal to cold runs, and each turn reports what it reused.

The tiny random-weight LLaVA (with its real processor) covers images: the turn after an image
reuses the image's 16 tokens. The real SmolLM2 covers a text chat with a system prompt. Every
turn runs with `--compare-cold`, which generates the same answer without the store and compares
the tokens.
"""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from PIL import Image

from hf_prefix_cache.errors import ModelUnavailableError
from hf_prefix_cache.frontends.cli import main
from hf_prefix_cache.frontends.engines import load_engine
from hf_prefix_cache.frontends.terminal_chat import chat_loop

REPORT = re.compile(r"^\[reused (\d+) of (\d+) prompt tokens(?: \(([^)]*)\))?; first token in [\d.]+ s(.*)\]$", re.M)


def test_piped_turns_with_an_image_equal_cold_and_reuse_the_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    picture = tmp_path / "teal.png"
    Image.new("RGB", (64, 48), "teal").save(picture)
    script = (
        f"Hello there\n/image {picture}\nWhat is in this picture?\nAnd its colours?\n/nonsense\n/image nowhere.png\n"
    )
    monkeypatch.setattr("sys.stdin", io.StringIO(script))
    assert main(["chat", "--tiny", "--compare-cold", "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert out.count("assistant: ") == 3 and "you: And its colours?" in out
    reports = REPORT.findall(out)
    assert len(reports) == 3, out
    assert all("identical to cold: yes" in r[3] for r in reports)
    (first, _, _, _), (second, _, _, _), (third, prompt, parts, _) = reports
    assert int(first) == 0 and int(second) > 0
    assert "image 16" in parts and int(third) > 16 and int(third) < int(prompt)
    assert "(attached teal.png to your next message)" in out
    assert "unknown command /nonsense" in out and "/image: no file 'nowhere.png'" in out


def test_a_text_chat_on_the_real_model_reuses_each_turn_exactly(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        engine, _ = load_engine("smollm2", max_new_tokens=12)
    except ModelUnavailableError as exc:
        pytest.skip(f"the real model cannot be loaded here: {exc}")
    try:
        reports = chat_loop(
            engine,
            ["What is the capital of France?", "And what is it famous for?", "/new", "Name a colour."],
            system="You are a terse assistant.",
            compare_cold=True,
        )
    finally:
        engine.store.detach()
    assert [r.same_as_cold for r in reports] == [True, True, True]
    first, second, fresh = reports
    assert first.reused_len == 0
    assert second.reused_len >= first.prompt_len - 1  # the whole first prompt, and what of the answer renders alike
    assert 0 < fresh.reused_len < first.prompt_len  # a new conversation reuses the system prompt only
    out = capsys.readouterr().out
    assert out.count("assistant: ") == 3 and "(a new conversation)" in out
