"""Session: keeps one conversation's latest stored entry warm while the conversation is open.

Pass a session where the store would go (`past_key_values=session`). After each call the
session pins the entry just stored (prompt and answer) and unpins the previous one, so the
next turn always finds its whole history on the device, whatever else the store evicts.
`close` (or leaving the `with` block) unpins it.

Knows the store's public lock/unlock calls; nothing about tensors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from types import TracebackType

    from hf_prefix_cache.store.tree_store import PrefixCache


class Session:
    """A named conversation on a store; see the module docstring.

    Example:
        >>> with store.session("alice") as chat:                         # doctest: +SKIP
        ...     out = model.generate(**turn1, past_key_values=chat)
        ...     out = model.generate(**turn2, past_key_values=chat)   # turn 1 is never evicted meanwhile
    """

    def __init__(self, store: PrefixCache, name: str) -> None:
        self.store = store
        self.name = name
        self._held: Any = None  # the tree node pinned for this session
        self.closed = False

    @property
    def held_len(self) -> int:
        """Length of the pinned entry (0 when none)."""
        return int(self._held.end) if self._held is not None else 0

    def hold(self, node: Any) -> None:
        """Pin `node` instead of the entry held so far. Called by the store under its lock."""
        if self.closed or node is self._held:
            return
        self.store._lock_node(node)
        if self._held is not None:
            self.store._unlock_node(self._held)
        self._held = node

    def close(self) -> None:
        """Unpin the held entry; the session is unusable afterwards."""
        self.store._end_session(self)

    def _release(self) -> None:
        if self._held is not None:
            self.store._unlock_node(self._held)
            self._held = None
        self.closed = True

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Session({self.name!r}, held_len={self.held_len}, closed={self.closed})"
