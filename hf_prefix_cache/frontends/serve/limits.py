"""The limits an operator sets: the largest body (413), how many generation requests at once (429), a timeout.

- `BodyLimit` reads a request's body before the app does and answers 413 past ``max_body_bytes``
  (at once when ``Content-Length`` says so);
- `Admission` counts the generation requests in the server (queued for the model's process
  or generating) from arrival until their response is sent; past ``max_queued`` a request gets
  429 with ``Retry-After`` (the seconds recent requests took, at least 1);
- the timeout is carried by each request (`requests.ServeRequest.deadline`): a job still queued at
  its deadline is answered 503 without running, one that starts is given the time left as
  ``max_time`` (`engine.run_job`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hf_prefix_cache.frontends.serve.errors import error_response

#: The endpoints that queue work for a model (and count against ``max_queued``).
GENERATION_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/audio/transcriptions", "/v1/systemone"}
)


class BodyLimit:
    """ASGI middleware: a body over `max_bytes` gets 413 before the app reads any of it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k.lower() == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send, int(declared))
            return
        messages: list[Message] = []
        total = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            total += len(message.get("body", b""))
            if total > self.max_bytes:
                await self._refuse(scope, receive, send, total)
                return
            messages.append(message)
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, nbytes: int) -> None:
        message = f"the request body has {'at least ' if nbytes <= self.max_bytes + 1 else ''}{nbytes} bytes; "
        message += f"this server takes at most {self.max_bytes} (--max-body-bytes)"
        await error_response(413, message)(scope, receive, send)


class Admission:
    """ASGI middleware: at most `max_queued` generation requests in the server; the next gets 429 with Retry-After.

    Args:
        app: the app.
        max_queued: requests admitted at once (queued or generating).
        retry_after: seconds a refused client should wait (read at each refusal).
        on_change: called with the number admitted whenever it changes (a gauge).
    """

    def __init__(
        self,
        app: ASGIApp,
        max_queued: int,
        retry_after: Callable[[], float] = lambda: 1.0,
        on_change: Callable[[int], Any] | None = None,
    ) -> None:
        self.app = app
        self.max_queued = max_queued
        self.retry_after = retry_after
        self.on_change = on_change
        self.admitted = 0  # the event loop's thread alone changes it

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        if self.admitted >= self.max_queued:
            wait = str(max(1, math.ceil(self.retry_after())))
            message = f"{self.admitted} requests are already queued or running (--max-queued {self.max_queued}); "
            message += f"retry after {wait} s"
            await error_response(429, message, headers={"Retry-After": wait})(scope, receive, send)
            return
        self._change(+1)
        try:
            await self.app(scope, receive, send)
        finally:
            self._change(-1)

    def _change(self, delta: int) -> None:
        self.admitted += delta
        if self.on_change is not None:
            self.on_change(self.admitted)
