"""Session: keeps one conversation's latest stored entry warm while the conversation is open.

Pass a session where the store would go (`cache=session`). After each call the
session pins the entry just stored (prompt and answer) and unpins the previous one, so the
next turn always finds its whole history on the device, whatever else the store evicts.
`close` (or leaving the `with` block) unpins it.

A session is plain state; the pinning is done by the store's `Pins` (`pins.py`), which sets
`held`. Knows nothing about tensors or the tree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from types import TracebackType


class SessionHost(Protocol):
    """What a session needs of its store: to end it (unpin its entry)."""

    def end_session(self, session: Session) -> None: ...


class Session:
    """A named conversation on a store; see the module docstring.

    Example:
        >>> with store.session("alice") as chat:
        ...     out = model.generate(ids, cache=chat, max_new_tokens=2)
        ...     turn2 = torch.cat([out, ids[:, :3]], dim=1)
        ...     out = model.generate(turn2, cache=chat, max_new_tokens=2)  # turn 1 stays pinned meanwhile
        ...     held = chat.held_len
        >>> held, chat.closed  # the whole conversation but its last token, never fed
        (42, True)
    """

    def __init__(self, store: SessionHost, name: str) -> None:
        self.store = store
        self.name = name
        self.held: Any = None  # the tree node pinned for this session (set by the store's `Pins`)
        self.closed = False

    @property
    def held_len(self) -> int:
        """Length of the pinned entry (0 when none)."""
        return int(self.held.end) if self.held is not None else 0

    def close(self) -> None:
        """Unpin the held entry; the session is unusable afterwards."""
        self.store.end_session(self)

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Session({self.name!r}, held_len={self.held_len}, closed={self.closed})"
