"""TokenIds: token ids with their int64 bytes, so the radix tree compares them at C speed.

Shared by the layer that reads ids from tensors (`integration/`) and the tree that compares
them (`tree/`); like `errors.py` and `reasons.py` it imports nothing of the package.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import SupportsIndex, overload


class TokenIds(tuple[int, ...]):
    """Token ids that carry their bytes as int64 (native order): the tree compares them at C speed.

    Made by the hooks from the same host copy of the ids as the ints themselves, so the two
    always agree. A slice keeps its bytes. A node inserted from a `TokenIds` query keeps its
    key's bytes beside the key (`Node.packed`, checked against the key by `checks.py`), so
    comparing a stored key with a query costs a `memcmp` instead of a Python comparison per token.
    It is immutable, so ids and bytes cannot drift apart, and it compares equal to a list of the
    same ids, as the lists of ids it stands in for did.

    >>> from array import array
    >>> ids = TokenIds([5, 6, 7], array("q", [5, 6, 7]).tobytes())
    >>> ids[1:] == [6, 7], ids[1:].packed == array("q", [6, 7]).tobytes()
    (True, True)
    """

    packed: bytes

    def __new__(cls, ids: Iterable[int], packed: bytes) -> TokenIds:
        self = super().__new__(cls, ids)
        assert len(packed) == 8 * len(self), f"{len(packed)} bytes for {len(self)} token ids"
        self.packed = packed
        return self

    def __getnewargs__(self) -> tuple[tuple[int, ...], bytes]:
        return tuple(self), self.packed  # pickle and copy rebuild it through `__new__`

    @overload
    def __getitem__(self, index: SupportsIndex) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[int, ...]: ...

    def __getitem__(self, index: SupportsIndex | slice) -> int | tuple[int, ...]:
        if not isinstance(index, slice):
            return tuple.__getitem__(self, index)
        start, stop, step = index.indices(len(self))
        if step != 1:
            return tuple.__getitem__(self, index)
        if start == 0 and stop >= len(self):
            return self
        stop = max(start, stop)
        return TokenIds(tuple.__getitem__(self, index), self.packed[8 * start : 8 * stop])

    def __eq__(self, other: object) -> bool:
        return tuple.__eq__(self, tuple(other) if isinstance(other, list) else other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = tuple.__hash__
