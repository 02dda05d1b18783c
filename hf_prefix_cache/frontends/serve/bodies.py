"""Request bodies parsed and checked off the event loop, so that a large body never holds ``/health`` back.

transformers' routes take their body as ``body: dict``: FastAPI parses it on the event loop, and a
body of several megabytes (under ``--max-body-bytes``) holds every other request, ``/health``
included, while it is parsed and then checked. `parse_off_loop` replaces the generating routes
(chat, text completions, Responses) with routes that read the body (asynchronously), parse it in
a worker thread (`parse_body`), and hand it to the same handlers, which check it in a thread too
(`app._Scoped`).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.routing import APIRoute

from hf_prefix_cache.frontends.serve.validate import RequestError

Handle = Callable[[dict[str, Any], str], Awaitable[Any]]


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body as the handlers take it: a JSON object (anything else is a 400).

    >>> parse_body(b'{"model": "m"}')
    {'model': 'm'}
    """
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(None, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError(None, f"the request body must be a JSON object, got a JSON {type(body).__name__}")
    return body


def parse_off_loop(app: FastAPI, handles: dict[str, Handle]) -> None:
    """Serve each path of `handles` (``POST``) by reading its body, parsing it in a thread and calling its handle."""
    app.router.routes[:] = [
        route for route in app.router.routes if not (isinstance(route, APIRoute) and route.path in handles)
    ]
    for path, handle in handles.items():
        app.add_api_route(path, _endpoint(handle), methods=["POST"])


def _endpoint(handle: Handle) -> Callable[[Request], Awaitable[Any]]:
    async def endpoint(request: Request) -> Any:
        raw = await request.body()
        body = await asyncio.to_thread(parse_body, raw)
        return await handle(body, request.state.request_id)

    return endpoint
