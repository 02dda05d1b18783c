"""Pins: the entries kept on the device and never evicted, named pins and sessions' latest entries alike.

A pin is a lock on a tree node (`RadixTree.lock`), which protects the node and its ancestors.
`PrefixCache.pin` adds a named one per prefix; a `Session` holds one on its conversation's
latest entry and moves it forward after each turn. Every method runs under the store's lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hf_prefix_cache.store.sessions import Session, SessionHost
from hf_prefix_cache.tree.radix import Node, RadixTree

PinKey = tuple[str, tuple[int, ...]]


class Pins:
    """Named pins and open sessions of one store's tree."""

    def __init__(self, tree: RadixTree[Any]) -> None:
        self._tree = tree
        self._named: dict[PinKey, Node[Any]] = {}
        self.sessions: dict[str, Session] = {}  # open sessions by name

    def add(self, namespace: str, tokens: Sequence[int], node: Node[Any]) -> bool:
        """Pin `node`, the entry ending at `tokens` in `namespace`; False when that prefix was pinned already."""
        key = (namespace, tuple(tokens))
        if key in self._named:
            return False
        self._tree.lock(node)
        self._named[key] = node
        return True

    def remove(self, namespace: str, tokens: Sequence[int]) -> bool:
        """Undo `add`; whether that prefix was pinned."""
        node = self._named.pop((namespace, tuple(tokens)), None)
        if node is None:
            return False
        self._tree.unlock(node)
        return True

    def session(self, host: SessionHost, name: str) -> Session:
        """The open session called `name`, made on first use (or after the last one closed)."""
        session = self.sessions.get(name)
        if session is None or session.closed:
            session = self.sessions[name] = Session(host, name)
        return session

    def hold(self, session: Session, node: Node[Any]) -> None:
        """Pin `node` for `session` instead of the entry it held so far (nothing for a closed session)."""
        if session.closed or node is session.held:
            return
        self._tree.lock(node)
        if session.held is not None:
            self._tree.unlock(session.held)
        session.held = node

    def end(self, session: Session) -> None:
        """Unpin `session`'s entry and close it."""
        if session.held is not None:
            self._tree.unlock(session.held)
            session.held = None
        session.closed = True
        if self.sessions.get(session.name) is session:
            del self.sessions[session.name]

    def clear(self) -> None:
        """Close every session and forget every named pin (before the tree is cleared)."""
        for session in list(self.sessions.values()):
            self.end(session)
        self._named.clear()
