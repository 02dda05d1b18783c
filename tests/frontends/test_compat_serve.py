"""`_compat.check_serve`: ``hf-prefix-cache serve`` needs transformers >= 5.25, and every place of its server we use."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("fastapi", reason="hf-prefix-cache serve needs transformers[serving]")

from hf_prefix_cache import _compat  # noqa: E402
from hf_prefix_cache.errors import UnsupportedVersionError  # noqa: E402

needs_engine_serve = pytest.mark.skipif(not _compat.HAS_ENGINE_SERVE, reason=str(_compat.serve_requirement()))


@pytest.mark.skipif(_compat.HAS_ENGINE_SERVE, reason="transformers >= 5.25 runs the server")
def test_an_older_release_stops_serve_with_one_line_naming_it_and_the_fix() -> None:
    """On 5.23 / 5.24 the command exits 2 with one line: the version found and ``pip install 'transformers>=5.25'``."""
    done = subprocess.run(
        [sys.executable, "-m", "hf_prefix_cache", "serve", "--port", "1"], capture_output=True, text=True, timeout=120
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert f"found {_compat.INSTALLED}" in lines[0] and "pip install 'transformers>=5.25'" in lines[0]
    with pytest.raises(UnsupportedVersionError, match=r"transformers>=5\.25"):
        _compat.check_serve()


@needs_engine_serve
def test_the_installed_release_has_everything() -> None:
    """On 5.25 the check passes."""
    _compat.check_serve()


@needs_engine_serve
def test_a_moved_method_fails_at_start_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A release without `EngineClient._send_request` stops the server with a message naming it and the versions."""
    from transformers.cli.serving import model_manager

    monkeypatch.delattr(model_manager.EngineClient, "_send_request")
    with pytest.raises(UnsupportedVersionError, match=r"EngineClient\._send_request.*tested on 5\.23"):
        _compat.check_serve()


@needs_engine_serve
def test_a_renamed_parameter_fails_at_start_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A handler whose `handle_request` no longer takes `request_id` is named too."""
    from transformers.cli.serving import chat_completion

    async def handle_request(self: object, body: dict[str, object], rid: str) -> None: ...

    monkeypatch.setattr(chat_completion.ChatCompletionHandler, "handle_request", handle_request)
    with pytest.raises(UnsupportedVersionError, match="takes no request_id"):
        _compat.check_serve()
