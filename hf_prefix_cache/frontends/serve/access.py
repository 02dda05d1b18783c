"""Who is calling: API keys that make tenants, an admin key for what only an operator may see.

With keys set (``--api-key``, ``--api-keys-file``, ``--admin-key``), every request but
``/health`` must carry one as ``Authorization: Bearer <key>``; without one, or with a wrong one,
it gets 401. A client key names its tenant (the server derives it, the client cannot choose it);
`requests.py` namespaces the store by it, so a ``cache_salt`` only narrows within the tenant.
The admin key alone reaches ``/metrics``, ``/reset``, ``/load_model`` and the full
``/v1/cache/stats`` (with its ``?check=true`` integrity walk); a tenant asking for the stats gets
only its own counters. With no keys at all, every caller is the operator (the loopback default).

>>> access = Access({"k1": "acme"}, admin_key="root")
>>> access.caller("Bearer k1"), access.caller("Bearer root").is_admin, access.caller("Bearer nope")
(Caller(tenant='acme', is_admin=False), True, None)
"""

from __future__ import annotations

import hmac
from contextvars import ContextVar
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from hf_prefix_cache.frontends.serve.errors import error_response

#: Paths anyone may reach, keys or not (load balancers' health checks).
OPEN_PATHS = frozenset({"/health"})
#: Paths only the admin key reaches when keys are set.
ADMIN_PATHS = frozenset({"/metrics", "/reset", "/load_model"})


@dataclass(frozen=True, slots=True)
class Caller:
    """Who sent a request: its tenant (None: the operator's own namespace) and whether it holds the admin key."""

    tenant: str | None
    is_admin: bool


OPERATOR = Caller(tenant=None, is_admin=True)
_CALLER: ContextVar[Caller] = ContextVar("hf_prefix_cache_serve_caller", default=OPERATOR)


def current_caller() -> Caller:
    """The caller of the request being handled (the operator when no keys are set)."""
    return _CALLER.get()


class Access:
    """The server's keys: each client key's tenant, and the admin key."""

    def __init__(self, keys: dict[str, str] | None = None, admin_key: str | None = None) -> None:
        self.keys = dict(keys or {})
        self.admin_key = admin_key or None

    @property
    def is_enabled(self) -> bool:
        """Whether requests need a key."""
        return bool(self.keys) or self.admin_key is not None

    def caller(self, authorization: str | None) -> Caller | None:
        """The caller an ``Authorization`` header names, or None for no key or a wrong one."""
        if not self.is_enabled:
            return OPERATOR
        scheme, _, key = (authorization or "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            return None
        found: Caller | None = None
        # Compare with every key in constant time, so timing tells nothing about which one is close.
        if self.admin_key is not None and hmac.compare_digest(key.encode(), self.admin_key.encode()):
            found = OPERATOR
        for known, tenant in self.keys.items():
            if hmac.compare_digest(key.encode(), known.encode()) and found is None:
                found = Caller(tenant=tenant, is_admin=False)
        return found


class AccessMiddleware:
    """ASGI middleware: 401 without a valid key, 403 for a tenant on an admin path; sets `current_caller`."""

    def __init__(self, app: ASGIApp, access: Access) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.access.is_enabled or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"authorization"), None)
        caller = self.access.caller(header)
        if caller is None:
            missing = "no API key was sent" if header is None else "the API key is not valid"
            response = error_response(
                401, f"{missing}: send Authorization: Bearer <key>", headers={"WWW-Authenticate": "Bearer"}
            )
            await response(scope, receive, send)
            return
        if scope["path"] in ADMIN_PATHS and not caller.is_admin:
            await error_response(403, f"{scope['path']} needs the admin key")(scope, receive, send)
            return
        token = _CALLER.set(caller)
        try:
            await self.app(scope, receive, send)
        finally:
            _CALLER.reset(token)
