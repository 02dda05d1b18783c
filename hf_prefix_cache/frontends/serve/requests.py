"""One request's way through transformers' server: its salt in, its reused prompt tokens out.

transformers' handlers run each request's `model.generate(**inputs)` on a per-model inference
thread, with no cache argument; the model's store (attached with ``attach="all"``) serves it.
This module carries a `RequestScope` along that path without copying any of the handlers:

1. `SaltHeader` (ASGI middleware) reads the ``x-cache-salt`` header into a context variable.
2. The handlers' `handle_request` (subclassed in `app.py`) call `scoped_request`: it takes the
   salt (the header, or a ``cache_salt`` body field, as vLLM names it), makes the request's
   scope and keeps it pending while transformers' handler runs.
3. `ScopedGenerateManager.submit` / `async_submit` (what the handler calls to start generation)
   wrap the job so the scope is active on the inference thread; the store salts the namespace
   with it and records the restored length in it before the first token.
4. The handler's response gets ``cached_tokens`` in its usage (`with_cached_tokens`): chat and
   text completions in ``usage.prompt_tokens_details``, the Responses API in
   ``usage.input_tokens_details``; in a stream, the chunk or event that carries the usage.

A client that disconnects mid-stream makes transformers raise inside `generate`; the store's
hook releases its pins in a `finally` and stores nothing for that request.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from typing import Any

from fastapi import HTTPException
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send
from transformers.cli.serving.utils import GenerateManager

from hf_prefix_cache.store.scope import RequestScope, active

SALT_HEADER = "x-cache-salt"
SALT_FIELD = "cache_salt"

_HEADER_SALT: ContextVar[str | None] = ContextVar("hf_prefix_cache_serve_header_salt", default=None)
# The scope of the request whose handler is running in this task, until it has started generation.
_PENDING: ContextVar[RequestScope | None] = ContextVar("hf_prefix_cache_serve_pending", default=None)


class SaltHeader:
    """ASGI middleware: the request's ``x-cache-salt`` header, for `scoped_request` to read."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        salt = next(
            (v.decode("latin-1") for k, v in scope["headers"] if k.decode("latin-1").lower() == SALT_HEADER), None
        )
        token = _HEADER_SALT.set(salt)
        try:
            await self.app(scope, receive, send)
        finally:
            _HEADER_SALT.reset(token)


def request_salt(body: dict[str, Any]) -> str | None:
    """The request's salt: its ``cache_salt`` field (removed from `body`) or its header; None for neither.

    Raises:
        HTTPException: 400 when the two disagree, or the salt is not a non-empty string.
    """
    field = body.pop(SALT_FIELD, None)
    header = _HEADER_SALT.get()
    if field is not None and header is not None and field != header:
        raise HTTPException(status_code=400, detail=f"the {SALT_FIELD} field and the {SALT_HEADER} header differ")
    salt = field if field is not None else header
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise HTTPException(status_code=400, detail=f"{SALT_FIELD} must be a non-empty string, got {salt!r}")
    return salt


async def scoped_request(
    handle: Callable[[dict[str, Any], str], Awaitable[Response]], body: dict[str, Any], request_id: str
) -> Response:
    """Run transformers' `handle(body, request_id)` with a scope of its own; report its reuse in the usage."""
    scope = RequestScope(request_salt(body))
    token = _PENDING.set(scope)
    try:
        response = await handle(body, request_id)
    finally:
        _PENDING.reset(token)
    return with_cached_tokens(response, scope)


def _within(fn: Callable[..., Any], scope: RequestScope | None) -> Callable[..., Any]:
    def scoped(*args: Any, **kwargs: Any) -> Any:
        with active(scope):
            return fn(*args, **kwargs)

    return scoped


class ScopedGenerateManager(GenerateManager):
    """transformers' sequential `GenerateManager`, running each job inside the scope of the request that sent it."""

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return super().submit(_within(fn, _PENDING.get()), *args, **kwargs)

    def async_submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return super().async_submit(_within(fn, _PENDING.get()), *args, **kwargs)


# ----------------------------------------------------------------------- usage
def set_cached_tokens(payload: Any, cached_len: int) -> bool:
    """Write `cached_len` into the OpenAI usage of `payload` (a response, chunk or event); whether it had one.

    >>> chunk = {"usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}}
    >>> set_cached_tokens(chunk, 8), chunk["usage"]["prompt_tokens_details"]
    (True, {'cached_tokens': 8})
    """
    if not isinstance(payload, dict):
        return False
    usage = payload.get("usage")
    if isinstance(usage, dict):
        key = "input_tokens_details" if "input_tokens" in usage else "prompt_tokens_details"
        usage[key] = {**(usage.get(key) or {}), "cached_tokens": cached_len}
        return True
    return set_cached_tokens(payload.get("response"), cached_len)  # a Responses API stream event


def _rewrite_events(chunk: str, scope: RequestScope) -> str:
    """Server-sent events with the usage they carry given `scope`'s cached tokens."""
    if '"usage"' not in chunk:
        return chunk
    lines = chunk.split("\n")
    for i, line in enumerate(lines):
        if not line.startswith("data: ") or '"usage"' not in line:
            continue
        try:
            payload = json.loads(line[len("data: ") :])
        except json.JSONDecodeError:
            continue
        if set_cached_tokens(payload, scope.cached_len):
            lines[i] = "data: " + json.dumps(payload, separators=(",", ":"))
    return "\n".join(lines)


async def _rewrite_stream(body: AsyncIterable[Any], scope: RequestScope) -> AsyncIterator[Any]:
    try:
        async for chunk in body:
            if isinstance(chunk, bytes):
                yield _rewrite_events(chunk.decode("utf-8"), scope).encode("utf-8")
            else:
                yield _rewrite_events(chunk, scope)
    finally:
        # Closing the stream (a client that disconnected) closes transformers' generator, which cancels generate.
        close = getattr(body, "aclose", None)
        if close is not None:
            await close()


def with_cached_tokens(response: Response, scope: RequestScope) -> Response:
    """`response` with ``cached_tokens`` set from `scope` wherever it reports usage (read when it is sent)."""
    if isinstance(response, StreamingResponse):
        response.body_iterator = _rewrite_stream(response.body_iterator, scope)
        return response
    if isinstance(response, JSONResponse) and response.status_code < 400:
        payload = json.loads(bytes(response.body))
        if set_cached_tokens(payload, scope.cached_len):
            headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
            return JSONResponse(payload, status_code=response.status_code, headers=headers)
    return response
