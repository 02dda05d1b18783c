"""What a request must be before the server spends anything on it: the OpenAI request schema, checked field by field.

transformers' handlers read a body as they go: a field of the wrong type or range surfaces as
a 500 from deep inside (``int("ten")``, an empty prompt's empty tensor) or as a silent 200
(``temperature: -1``; an image part that does not decode, dropped). Each handler of `app.py`
calls the check of its endpoint first (`check_chat`, `check_completion`, `check_response`);
the first wrong field is a `RequestError`, answered 400 in OpenAI's error format with the field
named (``param``) and what is allowed.

>>> check_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
>>> try:
...     check_chat({"messages": [{"role": "wizard", "content": "hi"}]})
... except RequestError as exc:
...     print(exc.param, "|", exc.detail)
messages[0].role | messages[0].role must be one of system, developer, user, assistant, tool, function; got 'wizard'
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
from collections.abc import Callable
from typing import Any

from fastapi import HTTPException

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
TEXT_PARTS = ("text", "input_text", "output_text")
IMAGE_PARTS = ("image_url", "input_image")
MAX_STOP = 4


class RequestError(HTTPException):
    """A malformed request: 400 (or `status_code`), naming the field (`param`) and what it must be."""

    def __init__(self, param: str | None, message: str, status_code: int = 400) -> None:
        super().__init__(status_code=status_code, detail=message)
        self.param = param


def _fail(param: str, must: str, got: Any) -> RequestError:
    shown = repr(got)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return RequestError(param, f"{param} must be {must}; got {shown}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)) and math.isfinite(value)


def _number(body: dict[str, Any], name: str, lo: float, hi: float) -> None:
    value = body.get(name)
    if value is not None and not (_is_number(value) and lo <= value <= hi):
        raise _fail(name, f"a number from {lo:g} to {hi:g}", value)


def _positive_int(body: dict[str, Any], name: str) -> None:
    value = body.get(name)
    if value is not None and not (_is_int(value) and value >= 1):
        raise _fail(name, "an integer of at least 1", value)


def _typed(body: dict[str, Any], name: str, kind: type, must: str) -> None:
    value = body.get(name)
    if value is not None and (not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool)):
        raise _fail(name, must, value)


def _common(body: dict[str, Any]) -> None:
    """The fields every generating endpoint shares: model, sampling, seed, stream, stop, generation_config."""
    _typed(body, "model", str, "a string naming the model")
    _number(body, "temperature", 0, 2)
    _number(body, "top_p", 0, 1)
    _number(body, "frequency_penalty", -2, 2)
    _number(body, "presence_penalty", -2, 2)
    _typed(body, "stream", bool, "true or false")
    seed = body.get("seed")
    if seed is not None and not (_is_int(seed) and 0 <= seed < 2**32):
        raise _fail("seed", "an integer from 0 to 2**32 - 1", seed)
    n = body.get("n")
    if n is not None and n != 1:
        raise _fail("n", "1 (this server answers one choice per request)", n)
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not (
            isinstance(stops, list) and 1 <= len(stops) <= MAX_STOP and all(isinstance(s, str) and s for s in stops)
        ):
            raise _fail("stop", f"a non-empty string or a list of 1 to {MAX_STOP} of them", stop)
    _generation_config(body.get("generation_config"))
    _typed(body, "chat_template_kwargs", dict, "an object")


# Fields of a generation_config with the values this server can honour (one answer, streamed token by token).
_CONFIG_RANGES: dict[str, tuple[float, float]] = {
    "num_beams": (1, 1),
    "num_return_sequences": (1, 1),
    "max_new_tokens": (1, math.inf),
    "min_new_tokens": (0, math.inf),
    "temperature": (0, 100),
    "top_p": (0, 1),
    "min_p": (0, 1),
    "top_k": (0, math.inf),
    "repetition_penalty": (1e-6, math.inf),
}


def _generation_config(value: Any) -> None:
    if value is None:
        return
    try:
        fields = json.loads(value) if isinstance(value, str) else None
    except ValueError:
        fields = None
    if not isinstance(fields, dict):
        raise _fail("generation_config", "a JSON string of an object of GenerationConfig fields", value)
    for name, value in fields.items():
        allowed = _CONFIG_RANGES.get(name)
        if allowed is not None and not (_is_number(value) and allowed[0] <= value <= allowed[1]):
            raise _fail(f"generation_config.{name}", f"a number from {allowed[0]:g} to {allowed[1]:g}", value)
    from transformers import GenerationConfig

    try:
        GenerationConfig(**fields).validate(strict=True)  # type: ignore[no-untyped-call]
    except (ValueError, TypeError) as exc:
        raise RequestError("generation_config", f"generation_config is not a valid GenerationConfig: {exc}") from exc


def _image(param: str, url: Any) -> None:
    """An image must be an http(s) URL or a data URL of base64 bytes that decode as an image."""
    if not isinstance(url, str) or not url:
        raise _fail(param, "an image URL (https://... or data:image/...;base64,...)", url)
    if url.startswith(("http://", "https://")):
        return
    head, comma, data = url.partition(",")
    if not (url.startswith("data:") and comma and head.endswith(";base64")):
        raise _fail(param, "an https:// URL or a data:image/...;base64,... URL", url)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RequestError(param, f"{param} is not valid base64: {exc}") from exc
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(raw)) as image:
            image.verify()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise RequestError(param, f"{param} does not decode as an image ({type(exc).__name__}: {exc})") from exc


def _url_of(part: dict[str, Any], name: str) -> Any:
    value = part.get(name)
    return value.get("url") if isinstance(value, dict) else value


def _part(param: str, part: Any) -> None:
    if not isinstance(part, dict):
        raise _fail(param, "a content part object", part)
    kind = part.get("type")
    if kind in TEXT_PARTS:
        if not isinstance(part.get("text"), str):
            raise _fail(f"{param}.text", "a string", part.get("text"))
    elif kind in IMAGE_PARTS:
        _image(f"{param}.image_url", _url_of(part, "image_url"))
    elif kind == "input_audio":
        audio = part.get("input_audio")
        data = audio.get("data") if isinstance(audio, dict) else audio
        if not isinstance(data, str) or not data:
            raise _fail(f"{param}.input_audio.data", "base64 audio", data)
    elif kind in ("video_url", "audio_url"):
        url = _url_of(part, kind)
        if not isinstance(url, str) or not url.startswith(("http://", "https://", "data:")):
            raise _fail(f"{param}.{kind}.url", "an http(s) or data: URL", url)
    else:
        allowed = ", ".join((*TEXT_PARTS, *IMAGE_PARTS, "input_audio", "video_url", "audio_url"))
        raise _fail(f"{param}.type", f"one of {allowed}", kind)


def _content(param: str, content: Any, may_be_empty: bool) -> None:
    if content is None and may_be_empty:
        return
    if isinstance(content, str):
        return
    if not isinstance(content, list) or (not content and not may_be_empty):
        raise _fail(param, "a string or a non-empty list of content parts", content)
    for i, part in enumerate(content):
        _part(f"{param}[{i}]", part)


def _tool_calls(param: str, calls: Any) -> None:
    if not isinstance(calls, list):
        raise _fail(param, "a list of tool calls", calls)
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise _fail(f"{param}[{i}].function", 'an object with a "name" string', function)
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = None
        if not isinstance(arguments, dict):
            raise _fail(
                f"{param}[{i}].function.arguments", "a JSON object (or a string of one)", function.get("arguments")
            )


def _message(param: str, message: Any) -> None:
    if not isinstance(message, dict):
        raise _fail(param, 'a message object {"role": ..., "content": ...}', message)
    role = message.get("role")
    if role not in ROLES:
        raise _fail(f"{param}.role", f"one of {', '.join(ROLES)}", role)
    has_calls = message.get("tool_calls") is not None
    if has_calls:
        _tool_calls(f"{param}.tool_calls", message["tool_calls"])
    if "content" not in message and not has_calls:
        raise RequestError(f"{param}.content", f"{param}.content is required (a string or a list of content parts)")
    _content(f"{param}.content", message.get("content"), may_be_empty=role == "assistant")


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


def check_chat(body: dict[str, Any]) -> None:
    """A ``/v1/chat/completions`` body (raises `RequestError` at its first wrong field)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _fail("messages", "a non-empty list of messages", messages)
    for i, message in enumerate(messages):
        _message(f"messages[{i}]", message)
    _common(body)
    _positive_int(body, "max_tokens")
    _positive_int(body, "max_completion_tokens")
    bias = body.get("logit_bias")
    if bias is not None and not (
        isinstance(bias, dict)
        and all(k.lstrip("-").isdigit() and _is_number(v) and -100 <= v <= 100 for k, v in bias.items())
    ):
        raise _fail("logit_bias", "an object of token ids to numbers from -100 to 100", bias)
    tools = body.get("tools")
    if tools is not None and not (
        isinstance(tools, list)
        and all(isinstance(t, dict) and isinstance((t.get("function") or {}).get("name"), str) for t in tools)
    ):
        raise _fail("tools", 'a list of {"type": "function", "function": {"name": ...}}', tools)


def check_completion(body: dict[str, Any]) -> None:
    """A ``/v1/completions`` body."""
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise _fail("prompt", "a non-empty string", prompt)
    _common(body)
    _positive_int(body, "max_tokens")
    _typed(body, "suffix", str, "a string")


def _input_item(param: str, item: Any) -> None:
    if not isinstance(item, dict):
        raise _fail(param, "an input item object", item)
    if "role" in item or item.get("type") == "message":
        role = item.get("role")
        if role not in ROLES:
            raise _fail(f"{param}.role", f"one of {', '.join(ROLES)}", role)
        _content(f"{param}.content", item.get("content"), may_be_empty=role == "assistant")
    elif not isinstance(item.get("type"), str):
        raise _fail(f"{param}.type", "a string naming the item type", item.get("type"))


def check_response(body: dict[str, Any]) -> None:
    """A ``/v1/responses`` body."""
    given = body.get("input")
    if isinstance(given, list) and given:
        for i, item in enumerate(given):
            _input_item(f"input[{i}]", item)
    elif not (isinstance(given, str) and given):
        raise _fail("input", "a non-empty string or a non-empty list of input items", given)
    _common(body)
    _positive_int(body, "max_output_tokens")
    _typed(body, "instructions", str, "a string")


CHECKS: dict[str, Callable[[dict[str, Any]], None]] = {
    "chat": check_chat,
    "completion": check_completion,
    "response": check_response,
}
