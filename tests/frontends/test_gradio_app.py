"""The Gradio chat, used as people use it: in a real browser (Debian's chromium through Playwright) and through gradio_client.

The app runs the tiny random-weight LLaVA with its real processor (the app's image model) on a
free loopback port. The browser sends two text turns and an image; the panel must report
reused tokens from the second turn on, and image tokens once a stored image is reused. A
gradio_client session then shares the same store: its first turn repeats the browser's first
prompt and must reuse it.

A second browser test chats two turns with the real SmolLM2-135M-Instruct (the app's default
model), compared with cold runs, and takes the screenshot shown in the README and the docs:
set HF_PREFIX_CACHE_SCREENSHOT=path to keep it (``docs/images/gradio_chat.png``).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("gradio", reason="the Gradio tests need the gradio extra: pip install -e '.[gradio]'")

from hf_prefix_cache.frontends.gradio_app import build_app, load_engine  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def app_url() -> Iterator[tuple[str, Any]]:
    engine, note = load_engine("tiny-vlm", max_new_tokens=6)
    app = build_app(engine, note)
    port = _free_port()
    app.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        yield f"http://127.0.0.1:{port}/", engine
    finally:
        app.close()
        engine.store.detach()


@pytest.fixture(scope="module")
def smollm2_url() -> Iterator[str]:
    from hf_prefix_cache.api.models import ModelUnavailableError

    try:
        engine, note = load_engine("smollm2", max_new_tokens=48)
    except ModelUnavailableError as exc:
        pytest.skip(f"the real model cannot be loaded here: {exc}")
    app = build_app(engine, note)
    port = _free_port()
    app.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        app.close()
        engine.store.detach()


def _send(page: Any, text: str, turn: int, files: Sequence[Path] = ()) -> str:
    """Type `text` (after attaching `files`) into the chat box, wait for the panel of `turn`, return its text."""
    if files:
        page.locator("input[type=file]").first.set_input_files([str(f) for f in files])
        page.wait_for_selector("img[src*='picture']", timeout=30_000)
    page.locator("textarea").first.fill(text)
    page.locator("textarea").first.press("Enter")
    page.wait_for_selector(f"#cache-panel[data-turn='{turn}']", timeout=120_000)
    return str(page.locator("#cache-panel").inner_text())


def _reused(panel_text: str) -> int:
    match = re.search(r"reused (\d+) of (\d+)", panel_text)
    assert match, panel_text
    return int(match.group(1))


needs_chromium = pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason=f"no chromium at {CHROMIUM} (apt-get install -y chromium)"
)


@needs_chromium
def test_browser_chat_reports_reuse_and_gradio_client_shares_the_store(
    app_url: tuple[str, Any], tmp_path: Path
) -> None:
    """Two text turns and an image in chromium show reused tokens (image tokens too); a gradio_client session reuses the browser's prompt."""
    from gradio_client import Client
    from playwright.sync_api import sync_playwright

    url, engine = app_url
    image = tmp_path / "picture.png"
    Image.fromarray((np.random.default_rng(0).random((48, 40, 3)) * 255).astype(np.uint8)).save(image)

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(url, wait_until="domcontentloaded")
            page.wait_for_selector("textarea")
            first = _send(page, "hello, who are you?", 1)
            assert _reused(first) == 0
            second = _send(page, "tell me more", 2)
            assert _reused(second) > 0
            third = _send(page, "what is in this picture?", 3, [image])
            assert _reused(third) > 0
            fourth = _send(page, "and its colours?", 4)
            assert re.search(r"image 16\b", fourth), fourth  # the stored image is reused, not encoded again
        finally:
            browser.close()

    client = Client(url, verbose=False)
    history, _box, panel_html, table = client.predict(
        {"text": "hello, who are you?", "files": []}, [], False, api_name="/chat"
    )
    assert _reused(panel_html) > 0  # another session, the same store: the browser's first prompt is reused
    history, _box, panel_html, table = client.predict(
        {"text": "say it again", "files": []}, history, True, api_name="/chat"
    )
    assert _reused(panel_html) > 0
    assert "identical to the cold run" in panel_html
    assert [row[6] for row in table["data"]] == ["-", "yes"]
    unchanged, *_ = client.predict({"text": "", "files": []}, history, False, api_name="/chat")
    assert len(unchanged) == len(history)  # an empty submit answers nothing
    assert len(engine.store._store._pins.sessions) == 2  # one store session per conversation
    stats = engine.store.stats()
    assert stats.hit_tokens_by_modality.get("image", 0) >= 16 and not stats.fallbacks


@needs_chromium
def test_browser_chat_on_smollm2_is_identical_to_cold_and_the_screenshot_shows_the_whole_panel(
    smollm2_url: str, tmp_path: Path
) -> None:
    """Two turns with the real SmolLM2 in chromium: the second reuses the first, both equal cold runs, and the panel fits the page."""
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            # Wide enough for the per-turn table's last column next to the chat (at 1600 px it scrolls sideways).
            page = browser.new_page(viewport={"width": 1920, "height": 760})
            page.goto(smollm2_url, wait_until="domcontentloaded")
            page.wait_for_selector("textarea")
            page.get_by_label("compare with a cold run", exact=False).check()
            first = _send(page, "What is the capital of France?", 1)
            assert _reused(first) == 0 and "identical to the cold run" in first, first
            second = _send(page, "And what is it famous for?", 2)
            assert _reused(second) > 0 and "identical to the cold run" in second, second
            # The per-turn table shows both turns with "yes" in its last column ("same as cold"); its
            # rows are spans (the <table> beside them only measures column widths).
            same = page.locator("span[placeholder]").filter(has_text=re.compile(r"^\s*yes\s*$"))
            expect(same).to_have_count(2, timeout=30_000)
            # The panel and that last column lie inside the page, and the table does not scroll sideways.
            width = page.evaluate("document.documentElement.clientWidth")
            for element in (page.locator("#cache-panel"), same.last):
                box = element.bounding_box()
                assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= width, (box, width)
            clipped = page.evaluate(
                "[...document.querySelectorAll('.virtual-table-viewport')].some(v => v.scrollWidth > v.clientWidth + 1)"
            )
            assert not clipped, "the per-turn table scrolls sideways: a column is cut off"
            shot = tmp_path / "gradio_chat.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            if os.environ.get("HF_PREFIX_CACHE_SCREENSHOT"):
                shutil.copy(shot, os.environ["HF_PREFIX_CACHE_SCREENSHOT"])
        finally:
            browser.close()


def test_gradio_client_uploads_a_wav_and_the_next_turn_reuses_it(tmp_path: Path) -> None:
    """Through gradio_client, a WAV uploaded to the tiny audio model is reused on the next turn (25 audio tokens)."""
    import wave

    from gradio_client import Client, handle_file

    clip = tmp_path / "tone.wav"
    with wave.open(str(clip), "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(8000)
        f.writeframes((np.sin(np.arange(8000) / 5) * 20000).astype(np.int16).tobytes())
    engine, note = load_engine("tiny-audio", max_new_tokens=4)
    app = build_app(engine, note)
    port = _free_port()
    app.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        history, _box, panel, _table = client.predict(
            {"text": "what is this sound?", "files": [handle_file(str(clip))]}, [], True, api_name="/chat"
        )
        assert _reused(panel) == 0 and "identical to the cold run" in panel
        # The client hands files back as local paths; a history sent again must upload them as files.
        for message in history:
            for block in message["content"]:
                if block.get("type") == "file":
                    block["file"] = handle_file(block["file"])
        history, _box, panel, _table = client.predict({"text": "again", "files": []}, history, True, api_name="/chat")
        assert re.search(r"audio 25\b", panel), panel
        assert "identical to the cold run" in panel
    finally:
        app.close()
        engine.store.detach()
