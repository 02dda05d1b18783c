"""Errors as OpenAI clients read them: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status.

Every refusal of the server goes out in this shape: transformers' own `HTTPException`s and `ValueError`s, ours
(`validate.RequestError`, which names the field in ``param``), and the middlewares' 401, 403,
413 and 429 (`error_response`).

>>> import json
>>> json.loads(bytes(error_response(429, "busy", headers={"Retry-After": "2"}).body))["error"]["type"]
'rate_limit_error'
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """A JSON response in OpenAI's error shape."""
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


async def http_exception_handler(_request: Request, exc: Exception) -> JSONResponse:
    """The app's handler of `HTTPException`: its status and detail in OpenAI's shape (``param`` when it names one)."""
    assert isinstance(exc, HTTPException)
    detail: Any = exc.detail
    message = detail if isinstance(detail, str) else str(detail)
    return error_response(exc.status_code, message, getattr(exc, "param", None), dict(exc.headers or {}))


async def value_error_handler(_request: Request, exc: Exception) -> JSONResponse:
    """transformers' request errors (`ValueError`: a model the server does not serve, a setting `generate` refuses, as
    its model's process sends them back): 400 in OpenAI's shape, as transformers answers them in its own."""
    return error_response(400, str(exc))
