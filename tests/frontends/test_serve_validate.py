"""`frontends/serve/validate.py`: request bodies checked against the pydantic models of `schema.py`, in process."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("fastapi", reason="hf-prefix-cache serve needs transformers[serving]")

from hf_prefix_cache._compat import serve_requirement  # noqa: E402

if serve_requirement() is not None:
    pytest.skip(serve_requirement(), allow_module_level=True)

from hf_prefix_cache.frontends.serve.validate import (  # noqa: E402
    CHUNK_LEN,
    RequestError,
    check_chat,
    check_response,
    check_text,
)

GOOD = {"role": "user", "content": "hi"}


def _refused(check: Any, body: dict[str, Any]) -> RequestError:
    with pytest.raises(RequestError) as refused:
        check(body)
    return refused.value


@pytest.mark.parametrize("where", [0, CHUNK_LEN - 1, CHUNK_LEN, 3 * CHUNK_LEN + 7])
def test_a_long_list_is_checked_in_chunks_and_its_wrong_item_named_by_its_index(where: int) -> None:
    """Messages are validated a chunk at a time (the GIL is let go between chunks); the wrong one is named exactly."""
    messages: list[Any] = [GOOD] * (4 * CHUNK_LEN)
    messages[where] = {"role": "wizard", "content": "hi"}
    refused = _refused(check_chat, {"messages": messages})
    assert refused.param == f"messages[{where}].role" and "'wizard'" in refused.detail
    messages[where] = {"role": "user", "content": [{"type": "text", "text": 3}]}
    assert _refused(check_chat, {"messages": messages}).param == f"messages[{where}].content[0].text"
    items: list[Any] = [{"role": "user", "content": "hi"}] * (2 * CHUNK_LEN)
    items[where % len(items)] = {"role": "user"}
    assert _refused(check_response, {"input": items}).param == f"input[{where % len(items)}].content"


def test_a_long_valid_list_passes_whole() -> None:
    check_chat({"messages": [GOOD] * (2 * CHUNK_LEN + 1), "logit_bias": {"1000": 5}, "stop": ["a", "b"]})


def test_union_errors_name_the_field_and_every_branch() -> None:
    """A field that may be one of several shapes is named once, with what each shape needed."""
    refused = _refused(check_chat, {"messages": [GOOD], "stop": ["a", "b", "c", "d", "e"]})
    assert refused.param == "stop" and "at most 4 items" in refused.detail
    refused = _refused(check_chat, {"messages": [{"role": "user", "content": [{"type": "sound"}]}]})
    assert refused.param == "messages[0].content[0].type" and "'sound'" in refused.detail
    assert _refused(check_chat, {"messages": [GOOD], "logit_bias": {"x": 1}}).param == "logit_bias"
    assert _refused(check_chat, {"messages": [GOOD], "temperature": True}).param == "temperature"  # strict: no coercion


def test_a_lone_surrogate_anywhere_is_named() -> None:
    refused = _refused(
        check_text, {"messages": [GOOD, {"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]}
    )
    assert refused.param == "messages[1].content[0].text" and "\\ud83d" in refused.detail
    check_text({"messages": [{"role": "user", "content": "a pair is fine: \U0001f600"}]})
