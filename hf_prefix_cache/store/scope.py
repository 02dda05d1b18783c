"""RequestScope: what the `generate` calls inside one ``with store.request()`` block reused, and the block's salt.

A scope belongs to one store (`PrefixCache.request` makes it). Entered (``with scope:``), it is
active in that thread or asyncio task only: the store counts each call made there into it as it
counts the call into its stats (the same numbers: a scope's counts are the change in `stats()`
that its calls made), and stores the calls' entries under the scope's salt.

The active scopes live in a `contextvars.ContextVar`, so each thread and each task sees its own.
Scopes nest: a call counts in every active scope of its store, and the innermost salt given
applies. A scope may be entered again, in the same or another thread (the one that runs a
streamed `generate`): the calls of every entry add up. Knows nothing of `generate` or of the
tree; the store reads `ACTIVE_SCOPES` (a plain hit outside any block makes no Python call here):
`counters.py` counts into `scopes_of` them, `keys.weights.Namespaces` salts with `salt_of` them.

>>> owner = object()  # a store's key (its `RequestCounters`)
>>> with RequestScope(owner, salt="tenant-a") as outer, RequestScope(owner) as inner:
...     salt_of(owner, ACTIVE_SCOPES.get()), scopes_of(owner, ACTIVE_SCOPES.get()) == (outer, inner)
('tenant-a', True)
>>> ACTIVE_SCOPES.get()
()
"""

from __future__ import annotations

import threading
from collections import Counter
from contextvars import ContextVar
from typing import Any

#: The scopes active in this thread or task, outermost first (of any store).
ACTIVE_SCOPES: ContextVar[tuple[RequestScope, ...]] = ContextVar("hf_prefix_cache_request_scopes", default=())


class RequestScope:
    """What the `generate` calls through one store inside a ``with store.request()`` block reused.

    Made by `PrefixCache.request`. Active in the thread or asyncio task that enters it, and only
    there (a thread started inside the block does not see it: enter the scope there too, or start
    the thread with `contextvars.copy_context().run`; `asyncio.to_thread` copies it). Only calls
    through its own store count, as they count in that store's `stats()`.

    Attributes:
        salt: the block's salt: its calls reuse only entries stored under the same salt, and store
            theirs under it (None: the salt of an enclosing block of the same store, if any, else the
            store's own namespace).
        cached_tokens: prompt tokens restored from the store, summed over the calls (0 when each
            missed or ran cold); over the rows of a batch, as `stats().hit_tokens`.
        prompt_tokens: prompt tokens of the calls, over their rows (as `stats().prompt_tokens`).
        calls: `generate` calls the store counted (served or run cold; as `stats().requests`).
        cached_tokens_by_modality: `cached_tokens` split into ``"text"``, ``"image"``, ``"video"`` and
            ``"audio"`` tokens (only kinds with tokens).
        fallbacks: why the calls reused less than they might, by reason, as in `stats().fallbacks`:
            each call run cold, and each served call that reused less or whose states were not stored.

    Example:
        >>> with store.request() as first:
        ...     _ = model.generate(ids, cache=store, max_new_tokens=4)
        >>> with store.request() as again:
        ...     _ = model.generate(ids, cache=store, max_new_tokens=4)
        >>> first.cached_tokens, again.cached_tokens, again.prompt_tokens, again.calls, again.fallbacks
        (0, 35, 36, 1, {})
    """

    __slots__ = ("salt", "_owner", "_lock", "_counts", "_by_modality", "_fallbacks")

    def __init__(self, owner: object, salt: str | None = None) -> None:
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"a request salt is a non-empty string, got {salt!r}")
        self.salt = salt
        self._owner = owner
        self._lock = threading.Lock()
        self._counts = [0, 0, 0]  # cached tokens, prompt tokens, calls
        self._by_modality: Counter[str] = Counter()
        self._fallbacks: Counter[str] = Counter()

    @property
    def cached_tokens(self) -> int:
        return self._counts[0]

    @property
    def prompt_tokens(self) -> int:
        return self._counts[1]

    @property
    def calls(self) -> int:
        return self._counts[2]

    @property
    def cached_tokens_by_modality(self) -> dict[str, int]:
        with self._lock:
            return {kind: n for kind, n in self._by_modality.items() if n}

    @property
    def fallbacks(self) -> dict[str, int]:
        with self._lock:
            return dict(self._fallbacks)

    def __enter__(self) -> RequestScope:
        ACTIVE_SCOPES.set((*ACTIVE_SCOPES.get(), self))
        return self

    def __exit__(self, *exc: Any) -> None:
        # By identity, not a token: an exit in another copy of the context (a generator resumed
        # elsewhere) finds nothing to remove there, and leaves the rest of its chain as it was.
        active = ACTIVE_SCOPES.get()
        for i in range(len(active) - 1, -1, -1):
            if active[i] is self:
                ACTIVE_SCOPES.set(active[:i] + active[i + 1 :])
                return

    def count_served(self, prompt_tokens: int, cached_tokens: int, by_modality: dict[str, int]) -> None:
        """Count one served call (what the store's counters call, with the numbers they count)."""
        with self._lock:
            counts = self._counts
            counts[0] += cached_tokens
            counts[1] += prompt_tokens
            counts[2] += 1
            self._by_modality.update(by_modality)

    def count_cold(self, reason: str, prompt_tokens: int) -> None:
        """Count one call run cold for `reason`."""
        with self._lock:
            self._counts[1] += prompt_tokens
            self._counts[2] += 1
            self._fallbacks[reason] += 1

    def count_reason(self, reason: str) -> None:
        """Count `reason` without a call (a served call that reused less, or was not stored)."""
        with self._lock:
            self._fallbacks[reason] += 1

    def __repr__(self) -> str:
        return (
            f"RequestScope(salt={self.salt!r}, cached_tokens={self.cached_tokens}, "
            f"prompt_tokens={self.prompt_tokens}, calls={self.calls}, fallbacks={self.fallbacks})"
        )


def scopes_of(owner: object, active: tuple[RequestScope, ...]) -> tuple[RequestScope, ...]:
    """The scopes of the store keyed `owner` among the `active` ones (`ACTIVE_SCOPES`), outermost first, each once."""
    found: list[RequestScope] = []
    for scope in active:
        if scope._owner is owner and scope not in found:
            found.append(scope)
    return tuple(found)


def salt_of(owner: object, active: tuple[RequestScope, ...]) -> str | None:
    """The salt in force for the store keyed `owner`: its innermost `active` scope's that has one (None: none)."""
    for scope in reversed(active):
        if scope._owner is owner and scope.salt is not None:
            return scope.salt
    return None
