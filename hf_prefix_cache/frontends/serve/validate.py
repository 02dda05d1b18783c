"""What a request must be before the server spends anything on it: the OpenAI request schema, as typed models.

transformers' handlers read a body as they go: a field of the wrong type or range surfaces as
a 500 from deep inside (``int("ten")``, an empty prompt's empty tensor) or as a silent 200
(``temperature: -1``; an image part that does not decode, dropped). Each handler of `app.py`
calls the check of its endpoint first (`check_chat`, `check_completion`, `check_response`), in a
worker thread: the body is validated against its pydantic model (`schema.py`), and the first wrong
field is a `RequestError`, answered 400 in OpenAI's error format with the field named (``param``,
as ``messages[0].content``) and what was wrong.

>>> check_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
>>> try:
...     check_chat({"messages": [{"role": "wizard", "content": "hi"}]})
... except RequestError as exc:
...     print(exc.param)
messages[0].role
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi import HTTPException
from pydantic import BaseModel, TypeAdapter, ValidationError

from hf_prefix_cache.frontends.serve.schema import (
    IMAGE_PARTS,
    MAX_STOP,
    ROLES,
    TEXT_PARTS,
    ChatBody,
    CompletionBody,
    GenerationSettings,
    ResponseBody,
)

__all__ = [
    "CHECKS",
    "IMAGE_PARTS",
    "MAX_STOP",
    "ROLES",
    "TEXT_PARTS",
    "RequestError",
    "check_chat",
    "check_completion",
    "check_response",
    "check_text",
]


class RequestError(HTTPException):
    """A malformed request: 400 (or `status_code`), naming the field (`param`) and what it must be."""

    def __init__(self, param: str | None, message: str, status_code: int = 400) -> None:
        super().__init__(status_code=status_code, detail=message)
        self.param = param


def _param(body: Any, loc: tuple[Any, ...], kind: str) -> str:
    """The field an error's pydantic location names, in the body's own terms (``messages[0].content[1].text``).

    A location also holds the branches of unions (``str``, ``list[...]``, a part's tag): walking the
    body along it keeps only what indexes into the body (and a missing field, last).
    """
    path: list[str | int] = []
    current = body
    for i, step in enumerate(loc):
        last = i == len(loc) - 1
        if step == "[key]":  # a dict's key failed: the dict is the field
            if path:
                path.pop()
            break
        if isinstance(current, list) and isinstance(step, int) and 0 <= step < len(current):
            path.append(step)
            current = current[step]
        elif isinstance(current, dict) and isinstance(step, str):
            if not last and current.get("type") == step:
                continue  # a tagged union's branch, named by the part's own type
            if step in current:
                path.append(step)
                current = current[step]
            elif last:
                path.append(step)  # a missing field
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        path.append("type")
    text = ""
    for step in path:
        text += f"[{step}]" if isinstance(step, int) else (f".{step}" if text else step)
    return text


def _shown(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


#: Items of a long list (``messages``, ``input``) validated per call: each call holds the GIL, and the event
#: loop (``/health`` included) waits for it; between chunks it runs.
CHUNK_LEN = 1000


def _validated(model: type[BaseModel], body: dict[str, Any], prefix: str = "") -> Any:
    """`body` validated as `model`; its first wrong field (the deepest error of it) as a `RequestError`.

    A long list the model names in ``chunked`` is validated a chunk of items at a time, so that no
    one call holds the GIL for the whole of a large body.
    """
    chunked: dict[str, type[BaseModel]] = getattr(model, "chunked", {})
    lists = {n: v for n in chunked if isinstance(v := body.get(n), list) and len(v) > CHUNK_LEN}
    head = {**body, **{name: items[:1] for name, items in lists.items()}} if lists else body
    try:
        result = model.model_validate(head)
    except ValidationError as exc:
        raise _refusal(body, exc.errors(include_url=False), prefix) from None
    for name, items in lists.items():
        item_type: Any = chunked[name]
        adapter: TypeAdapter[list[Any]] = TypeAdapter(list[item_type])
        validated: list[Any] = []
        for start in range(0, len(items), CHUNK_LEN):
            try:
                validated += adapter.validate_python(items[start : start + CHUNK_LEN], strict=True)
            except ValidationError as exc:
                errors = [
                    {**e, "loc": (name, start + int(e["loc"][0]), *e["loc"][1:])} for e in exc.errors(include_url=False)
                ]
                raise _refusal(body, errors, prefix) from None
        setattr(result, name, validated)
    return result


def _refusal(body: dict[str, Any], errors: list[Any], prefix: str) -> RequestError:
    """The first wrong field of `errors` (the deepest error of it) as a `RequestError`."""
    first = errors[0]["loc"][:1]
    same = [e for e in errors if e["loc"][:1] == first]
    params = [_param(body, e["loc"], e["type"]) for e in same]
    deepest = max(params, key=len)  # a union's branch that got furthest says most
    named = [e for e, p in zip(same, params, strict=True) if p == deepest]
    messages = dict.fromkeys(e["msg"].removeprefix("Value error, ") for e in named)  # each once, in order
    param = f"{prefix}.{deepest}" if prefix and deepest else (prefix or deepest)
    message = ", or ".join(messages)
    return RequestError(param, f"{param}: {message}; got {_shown(named[0].get('input'))}")


def _generation_config(value: str | None) -> None:
    if value is None:
        return
    try:
        fields = json.loads(value)
    except ValueError:
        fields = None
    if not isinstance(fields, dict):
        raise RequestError(
            "generation_config", f"generation_config must be a JSON string of an object; got {_shown(value)}"
        )
    _validated(GenerationSettings, fields, "generation_config")
    from transformers import GenerationConfig

    try:
        GenerationConfig(**fields).validate(strict=True)  # type: ignore[no-untyped-call]
    except (ValueError, TypeError) as exc:
        raise RequestError("generation_config", f"generation_config is not a valid GenerationConfig: {exc}") from exc


def _content_rules(param: str, role: str | None, content: Any, has_calls: bool) -> None:
    """A message needs content unless it calls tools; only an assistant's may be empty."""
    if role == "assistant" or has_calls:
        return
    if content is None:
        raise RequestError(f"{param}.content", f"{param}.content is required (a string or a list of content parts)")
    if content == []:
        raise RequestError(f"{param}.content", f"{param}.content must be a string or a non-empty list of parts")


def check_chat(body: dict[str, Any]) -> None:
    """A ``/v1/chat/completions`` body (raises `RequestError` at its first wrong field)."""
    chat = _validated(ChatBody, body)
    for i, message in enumerate(chat.messages):
        _content_rules(f"messages[{i}]", message.role, message.content, message.tool_calls is not None)
    _generation_config(chat.generation_config)


def check_completion(body: dict[str, Any]) -> None:
    """A ``/v1/completions`` body."""
    _generation_config(_validated(CompletionBody, body).generation_config)


def check_response(body: dict[str, Any]) -> None:
    """A ``/v1/responses`` body."""
    response = _validated(ResponseBody, body)
    if isinstance(response.input, list):
        for i, item in enumerate(response.input):
            if item.role is not None or item.type == "message":
                if item.role is None:
                    raise RequestError(f"input[{i}].role", f"input[{i}].role must be one of {', '.join(ROLES)}")
                _content_rules(f"input[{i}]", item.role, item.content, False)
            elif item.type is None:
                raise RequestError(f"input[{i}].type", f"input[{i}].type must be a string naming the item type")
    _generation_config(response.generation_config)


def check_text(value: Any, param: str = "") -> None:
    """Every string of a body must be encodable text: a lone surrogate (JSON's ``"\\ud800"``) is a 400 naming its field.

    >>> try:
    ...     check_text({"messages": [{"role": "user", "content": "hi \\ud800"}]})
    ... except RequestError as exc:
    ...     print(exc.param)
    messages[0].content
    """
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RequestError(
                param or None,
                f"{param or 'the body'} holds a lone surrogate (\\u{ord(value[exc.start]):04x}) at character "
                f"{exc.start}: text must be valid Unicode (a surrogate pair's two halves together)",
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            check_text(key, param)
            check_text(item, f"{param}.{key}" if param else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_text(item, f"{param}[{i}]")


CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "chat": check_chat,
    "completion": check_completion,
    "response": check_response,
}
