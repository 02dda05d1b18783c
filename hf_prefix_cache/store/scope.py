"""RequestScope: what one request asks of every store its `generate` calls reach, and what they tell it back.

A server runs each request's `generate` on a worker thread, through a store attached with
``attach="all"``, with no cache argument to carry per-request settings. A scope carries them:
activated around the call (`active`), it gives the request its own salt (entries stored
under another salt, or none, are never reused) and receives the number of prompt tokens the
stores restored for it, as soon as each prefix is restored (before the first new token).

The scope lives in a `contextvars.ContextVar`: each thread and each asyncio task sees its own.
Knows nothing of `generate` or of servers; the store reads it (`prefixes.py`, and `keys.weights.Namespaces`, passed it).

>>> scope = RequestScope(salt="tenant-a")
>>> with active(scope):
...     current() is scope
True
>>> current() is None
True
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

#: The scope active in this thread or task; the store's hot path reads it with `CURRENT_SCOPE.get()`.
CURRENT_SCOPE: ContextVar[RequestScope | None] = ContextVar("hf_prefix_cache_request_scope", default=None)


class RequestScope:
    """One request's salt, and the prompt tokens restored for it (filled in by the stores).

    Args:
        salt: keeps this request's entries apart from every other salt's (and from unsalted
            ones), on top of the store's own `salt`. None: the store's namespace as it is.

    Attributes:
        cached_len: prompt tokens restored from a store, summed over the calls made in the scope
            (0 when every call missed or ran cold).
        num_calls: how many calls a store served in the scope (a cold run does not count).
    """

    __slots__ = ("salt", "cached_len", "num_calls", "_lock")

    def __init__(self, salt: str | None = None) -> None:
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"a request salt is a non-empty string, got {salt!r}")
        self.salt = salt
        self.cached_len = 0
        self.num_calls = 0
        self._lock = threading.Lock()

    def record(self, cached_len: int) -> None:
        """Add one served call's restored length (what a store calls once a prefix is restored)."""
        with self._lock:
            self.cached_len += cached_len
            self.num_calls += 1

    def __repr__(self) -> str:
        return f"RequestScope(salt={self.salt!r}, cached_len={self.cached_len}, num_calls={self.num_calls})"


def current() -> RequestScope | None:
    """The scope active in this thread or task, or None."""
    return CURRENT_SCOPE.get()


@contextmanager
def active(scope: RequestScope | None) -> Iterator[RequestScope | None]:
    """Make `scope` the current one for the block (None: no scope), restoring the previous one after."""
    token = CURRENT_SCOPE.set(scope)
    try:
        yield scope
    finally:
        CURRENT_SCOPE.reset(token)
