"""The serve tests' server processes (`hf_prefix_cache.testing.serve_process`), skipped without the serving extra
or before transformers 5.25."""

from __future__ import annotations

import pytest

pytest.importorskip("openai", reason="the serve tests drive the server with the openai client")
pytest.importorskip("fastapi", reason="hf-prefix-cache serve needs transformers[serving]")

from hf_prefix_cache._compat import serve_requirement  # noqa: E402

if serve_requirement() is not None:  # the serve tests run where the server does: transformers >= 5.25
    pytest.skip(serve_requirement(), allow_module_level=True)

from hf_prefix_cache.testing.serve_process import (  # noqa: E402
    ServeProcess,
    free_port,
    image_url,
    tiny_chat_folder,
    tiny_vlm_folder,
)

__all__ = ["ServeProcess", "free_port", "image_url", "tiny_chat_folder", "tiny_vlm_folder"]
