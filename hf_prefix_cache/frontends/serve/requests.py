"""One request's way through transformers' server: its tenant and salt in, its reused prompt tokens out.

transformers' handlers send each request's `model.generate(**inputs)` to the model's process,
with no cache argument; the model's store (attached there with ``attach="all"``) serves it.
This module carries a `ServeRequest` (its salt, tenant, deadline; its cached tokens back) along that path
without copying any of the handlers:

1. `SaltHeader` (ASGI middleware) reads the ``x-cache-salt`` header into a context variable.
2. The handlers' `handle_request` (subclassed in `app.py`) call `scoped_request`: it takes the
   salt (the header, or a ``cache_salt`` body field, as vLLM names it, at most
   ``MAX_SALT_LEN`` characters), joins it under the caller's tenant (`access.py`: a tenant is
   derived from its API key, so a salt only narrows within it), makes the `ServeRequest` and
   keeps the request pending while transformers' handler runs.
3. `client.ScopedEngineClient` (what the handler calls to start generation) sends the job to
   the model's process with the request's `engine.Ticket` (salt and tenant); there it runs in a
   ``with store.request(salt)`` block, and the block's ``cached_tokens`` come back with the job's end.
4. The handler's response gets ``cached_tokens`` in its usage (`with_cached_tokens`): chat and
   text completions in ``usage.prompt_tokens_details``, the Responses API in
   ``usage.input_tokens_details``; in a stream, the chunk or event that carries the usage. Its
   ``model`` is the served name (``--served-model-name``).

A client that disconnects mid-stream stops its `generate` after the current token; what was
computed (the prompt, and the tokens so far) is stored as any finished request's is.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from hf_prefix_cache.frontends.serve.access import current_caller
from hf_prefix_cache.frontends.serve.metrics import now
from hf_prefix_cache.frontends.serve.validate import RequestError
from hf_prefix_cache.frontends.serve_args import MAX_SALT_LEN

SALT_HEADER = "x-cache-salt"
SALT_FIELD = "cache_salt"
#: The fields that ask for a number of new tokens (explicit: over the context is a 400, not a clamp).
MAX_NEW_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")

_HEADER_SALT: ContextVar[str | None] = ContextVar("hf_prefix_cache_serve_header_salt", default=None)
# The request whose handler is running in this task, until it has started generation.
_PENDING: ContextVar[ServeRequest | None] = ContextVar("hf_prefix_cache_serve_pending", default=None)


@dataclass(slots=True)
class ServeRequest:
    """One request on its way to `generate`: its salt in, its cached tokens out, who sent it, its limits.

    Attributes:
        salt: its store salt (`tenant_salt`: its tenant's and its client salt; None: neither).
        cached_tokens: prompt tokens its `generate` calls restored from the store (set when its job ends).
        tenant: the caller's tenant (None: the operator).
        model_name: the name the request is answered and measured under.
        arrival: when it arrived (`metrics.now`); deadline: when it must be done (None: never).
        max_new_field: the body's field naming a number of new tokens (None: it named none).
        cancel: set by `client.py`: stops the request's `generate` after the current token.
    """

    salt: str | None
    cached_tokens: int = 0
    tenant: str | None = None
    model_name: str = ""
    arrival: float = field(default_factory=now)
    deadline: float | None = None
    max_new_field: str | None = None
    cancel: Callable[[], None] | None = None


def pending() -> ServeRequest | None:
    """The request whose handler runs in this task, until it has sent its job to the model's process."""
    return _PENDING.get()


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
        RequestError: 400 when the two disagree, or the salt is not a non-empty string of at most
            ``MAX_SALT_LEN`` characters.
    """
    field = body.pop(SALT_FIELD, None)
    header = _HEADER_SALT.get()
    if field is not None and header is not None and field != header:
        raise RequestError(SALT_FIELD, f"the {SALT_FIELD} field and the {SALT_HEADER} header differ")
    salt = field if field is not None else header
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise RequestError(SALT_FIELD, f"{SALT_FIELD} must be a non-empty string, got {str(salt)[:40]!r}")
    if salt is not None and len(salt) > MAX_SALT_LEN:
        raise RequestError(SALT_FIELD, f"{SALT_FIELD} must be at most {MAX_SALT_LEN} characters; got {len(salt)}")
    return salt


def tenant_salt(tenant: str | None, salt: str | None) -> str | None:
    """The store salt of a request: its tenant and its client salt framed as one JSON array (neither: None).

    One-to-one: every pair but (None, None) becomes ``[tenant, salt]``, and no request's salt reaches
    the store unframed, so no salt a client (or the operator) writes can spell another tenant's
    namespace, whatever it contains:

    >>> tenant_salt("acme", None) != tenant_salt("globex", "acme")
    True
    >>> tenant_salt("acme", None) != tenant_salt(None, tenant_salt("acme", None))
    True
    >>> tenant_salt(None, None) is None, tenant_salt(None, "x")
    (True, '[null,"x"]')
    """
    if tenant is None and salt is None:
        return None
    return json.dumps([tenant, salt], separators=(",", ":"))


async def scoped_request(
    handle: Callable[[dict[str, Any], str], Awaitable[Response]],
    body: dict[str, Any],
    request_id: str,
    names: ModelNames | None = None,
    timeout: float | None = None,
) -> Response:
    """Run transformers' `handle(body, request_id)` as a `ServeRequest` of its own; report its reuse in the usage.

    `names` maps the served model name in ``body["model"]`` to the model transformers loaded, and
    names the answer; `timeout` (seconds) sets the request's deadline.
    """
    tenant = current_caller().tenant
    request = ServeRequest(tenant_salt(tenant, request_salt(body)), tenant=tenant)
    if timeout is not None:
        request.deadline = request.arrival + timeout
    request.max_new_field = next((name for name in MAX_NEW_FIELDS if body.get(name) is not None), None)
    if names is not None:
        request.model_name = names.resolve(body)
    token = _PENDING.set(request)
    try:
        response = await handle(body, request_id)
    finally:
        _PENDING.reset(token)
    return with_cached_tokens(response, request)


@dataclass(frozen=True, slots=True)
class ModelNames:
    """The served name of the forced model (``--served-model-name``) and the name transformers loaded it under."""

    served: str | None
    loaded: str | None

    def resolve(self, body: dict[str, Any]) -> str:
        """Point a body naming the served model at the loaded one; the name the answer goes out under."""
        requested = body.get("model")
        if self.served is not None and self.loaded is not None and requested in (self.served, None):
            body["model"] = self.loaded
            return self.served
        if self.served is not None and requested == self.loaded:
            return self.served
        return str(requested or "")


# ----------------------------------------------------------------------- usage
def set_cached_tokens(payload: Any, cached_len: int, model_name: str = "") -> bool:
    """Write `cached_len` into the OpenAI usage of `payload` (a response, chunk or event); whether it had one.

    >>> chunk = {"usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}}
    >>> set_cached_tokens(chunk, 8), chunk["usage"]["prompt_tokens_details"]
    (True, {'cached_tokens': 8})
    """
    if not isinstance(payload, dict):
        return False
    if model_name and isinstance(payload.get("model"), str):
        payload["model"] = model_name
    usage = payload.get("usage")
    if isinstance(usage, dict):
        key = "input_tokens_details" if "input_tokens" in usage else "prompt_tokens_details"
        usage[key] = {**(usage.get(key) or {}), "cached_tokens": cached_len}
        return True
    return set_cached_tokens(payload.get("response"), cached_len, model_name)  # a Responses API stream event


def _rewrite_events(chunk: str, request: ServeRequest) -> str:
    """Server-sent events with the usage they carry given the request's cached tokens, and its model's name."""
    if '"usage"' not in chunk and not request.model_name:
        return chunk
    lines = chunk.split("\n")
    for i, line in enumerate(lines):
        if not line.startswith("data: ") or ('"usage"' not in line and '"model"' not in line):
            continue
        try:
            payload = json.loads(line[len("data: ") :])
        except json.JSONDecodeError:
            continue
        has_usage = set_cached_tokens(payload, request.cached_tokens, request.model_name)
        if has_usage or request.model_name:
            lines[i] = "data: " + json.dumps(payload, separators=(",", ":"))
    return "\n".join(lines)


async def _rewrite_stream(body: AsyncIterable[Any], request: ServeRequest) -> AsyncIterator[Any]:
    try:
        async for chunk in body:
            if isinstance(chunk, bytes):
                yield _rewrite_events(chunk.decode("utf-8"), request).encode("utf-8")
            else:
                yield _rewrite_events(chunk, request)
    finally:
        # Closing the stream (a client that disconnected) closes transformers' generator, which cancels generate.
        close = getattr(body, "aclose", None)
        if close is not None:
            await close()


class _CancelWhenDone(Response):
    """A streamed response that stops its request's `generate` once it ends, however it ends.

    A client that leaves before the stream's body starts never runs transformers' clean-up
    (it lives in the body's generator): this makes sure the job stops after its prefill anyway.
    """

    def __init__(self, inner: StreamingResponse, request: ServeRequest) -> None:
        self.inner = inner
        self.request = request
        self.status_code = inner.status_code
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.inner(scope, receive, send)
        finally:
            if self.request.cancel is not None:
                self.request.cancel()


def with_cached_tokens(response: Response, request: ServeRequest) -> Response:
    """`response` with ``cached_tokens`` set from the request's own wherever it reports usage (read when sent)."""
    if isinstance(response, StreamingResponse):
        response.body_iterator = _rewrite_stream(response.body_iterator, request)
        return _CancelWhenDone(response, request)
    if isinstance(response, JSONResponse) and response.status_code < 400:
        payload = json.loads(bytes(response.body))
        if set_cached_tokens(payload, request.cached_tokens, request.model_name):
            headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
            return JSONResponse(payload, status_code=response.status_code, headers=headers)
    return response
