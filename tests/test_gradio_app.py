"""The Gradio chat, used as people use it: in a real browser (Debian's chromium through Playwright) and through gradio_client.

The app runs the tiny random-weight LLaVA with its real processor (the app's image model) on a
free loopback port. The browser sends two text turns and an image; the panel must report
reused tokens from the second turn on, and image tokens once a stored image is reused. A
gradio_client session then shares the same store: its first turn repeats the browser's first
prompt and must reuse it. Set HF_PREFIX_CACHE_SCREENSHOT=path to keep the screenshot.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from hf_prefix_cache.frontends.gradio_app import build_app, load_engine

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


def _reused(panel_text: str) -> int:
    match = re.search(r"reused (\d+) of (\d+)", panel_text)
    assert match, panel_text
    return int(match.group(1))


@pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"no chromium at {CHROMIUM} (apt-get install -y chromium)")
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
            panel = page.locator("#cache-panel")

            def send(text: str, turn: int, files: list[Path] = ()) -> str:  # type: ignore[assignment]
                if files:
                    page.locator("input[type=file]").first.set_input_files([str(f) for f in files])
                    page.wait_for_selector("img[src*='picture']", timeout=30_000)
                page.locator("textarea").first.fill(text)
                page.locator("textarea").first.press("Enter")
                page.wait_for_selector(f"#cache-panel[data-turn='{turn}']", timeout=60_000)
                return panel.inner_text()

            first = send("hello, who are you?", 1)
            assert _reused(first) == 0
            second = send("tell me more", 2)
            assert _reused(second) > 0
            third = send("what is in this picture?", 3, [image])
            assert _reused(third) > 0
            fourth = send("and its colours?", 4)
            assert re.search(r"image 16\b", fourth), fourth  # the stored image is reused, not encoded again
            shot = tmp_path / "gradio_chat.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            if os.environ.get("HF_PREFIX_CACHE_SCREENSHOT"):
                shutil.copy(shot, os.environ["HF_PREFIX_CACHE_SCREENSHOT"])
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
    assert len(engine.store._sessions) == 2  # one store session per conversation
    stats = engine.store.stats()
    assert stats.hit_tokens_by_modality.get("image", 0) >= 16 and not stats.fallbacks


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
