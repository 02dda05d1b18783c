"""`_compat.check_serve`: the installed transformers' server has every place `hf-prefix-cache serve` builds on."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="hf-prefix-cache serve needs transformers[serving]")

from hf_prefix_cache import _compat  # noqa: E402
from hf_prefix_cache.errors import UnsupportedVersionError  # noqa: E402


def test_the_installed_release_has_everything() -> None:
    """On a tested release (5.23, 5.24) the check passes."""
    _compat.check_serve()


def test_a_moved_method_fails_at_start_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A release without `GenerateManager.async_submit` stops the server with a message naming it and the versions."""
    from transformers.cli.serving import utils

    monkeypatch.delattr(utils.GenerateManager, "async_submit")
    with pytest.raises(UnsupportedVersionError, match=r"GenerateManager\.async_submit.*tested on 5\.23"):
        _compat.check_serve()


def test_a_renamed_parameter_fails_at_start_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A handler whose `handle_request` no longer takes `request_id` is named too."""
    from transformers.cli.serving import chat_completion

    async def handle_request(self: object, body: dict[str, object], rid: str) -> None: ...

    monkeypatch.setattr(chat_completion.ChatCompletionHandler, "handle_request", handle_request)
    with pytest.raises(UnsupportedVersionError, match="takes no request_id"):
        _compat.check_serve()


def test_models_listing_flag_matches_the_release() -> None:
    """`LISTS_FORCED_MODEL` is true exactly where `ModelManager` has 5.24's `list_models`."""
    from transformers.cli.serving.model_manager import ModelManager

    assert hasattr(ModelManager, "list_models") == _compat.LISTS_FORCED_MODEL
