"""TokenIds: token ids held as their int64 bytes, so the radix tree compares them at C speed.

Shared by the layer that reads ids from tensors (`hooks/`) and the tree that compares
them (`tree/`); like `errors.py` and `reasons.py` it imports nothing of the package.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, SupportsIndex, overload

from hf_prefix_cache.errors import InconsistentStateError


class TokenIds(Sequence[int]):
    """Token ids held as int64 bytes (native order): the tree compares them at C speed, and no Python int is
    made until something asks for one.

    Made by the hooks from the host copy of the ids (`from_bytes`): a hit reads its prompt, matches
    it and stores it without turning it into Python ints (32k of them cost about half a
    millisecond); the node it inserts keys only its new ids. Indexing, iteration and `in` read the
    bytes through a `memoryview` (`view`) in C; `ids`, the tuple of ints, is built on first use
    (equality with a tuple or list, hashing, `repr`) and kept. A slice keeps its bytes. A node
    inserted from a `TokenIds` query keeps its key's bytes beside the key (`Node.packed`, checked
    against the key by `tree/checks.py`), so comparing a stored key with a query costs a `memcmp`
    instead of a Python comparison per token. It is immutable, so ids and bytes cannot drift apart;
    it compares equal (and hashes equal) to the tuple of the same ids, and equal to a list of them,
    as the tuples and lists of ids it stands in for did.

    >>> from array import array
    >>> ids = TokenIds.from_bytes(array("q", [5, 6, 7]).tobytes())
    >>> ids[1:] == [6, 7], ids[1:].packed == array("q", [6, 7]).tobytes(), ids[0], 7 in ids
    (True, True, 5, True)
    >>> TokenIds([5, 6, 7], ids.packed) == (5, 6, 7), hash(ids) == hash((5, 6, 7)), ids
    (True, True, (5, 6, 7))
    """

    __slots__ = ("_ids", "packed", "view")

    #: The ids as int64 bytes (native order).
    packed: bytes
    #: The same bytes as a read-only `memoryview` of format ``"q"``: indexing, iteration and `len` in C.
    view: memoryview
    _ids: tuple[int, ...] | None

    def __init__(self, ids: Iterable[int], packed: bytes) -> None:
        """Ids and their int64 bytes, read from the same host copy (`from_bytes` needs only the bytes)."""
        ints = tuple(ids)
        if len(packed) != 8 * len(ints):
            raise InconsistentStateError(f"{len(packed)} bytes for {len(ints)} token ids")
        self.packed = packed
        self.view = memoryview(packed).cast("q")
        self._ids = ints

    @classmethod
    def from_bytes(cls, packed: bytes) -> TokenIds:
        """The ids whose int64 bytes (native order) are `packed`; no Python int is made."""
        self = cls.__new__(cls)
        self.packed = packed
        self.view = memoryview(packed).cast("q")  # raises on a length that is not a whole number of ids
        self._ids = None
        return self

    @property
    def ids(self) -> tuple[int, ...]:
        """The ids as a tuple of Python ints, built on first use and kept."""
        ids = self._ids
        if ids is None:
            ids = self._ids = tuple(self.view.tolist())
        return ids

    def __len__(self) -> int:
        return len(self.packed) >> 3

    @overload
    def __getitem__(self, index: SupportsIndex) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> TokenIds | tuple[int, ...]: ...

    def __getitem__(self, index: SupportsIndex | slice) -> int | TokenIds | tuple[int, ...]:
        if not isinstance(index, slice):
            value: int = self.view[index]
            return value
        start, stop, step = index.indices(len(self.packed) >> 3)
        if step != 1:
            return tuple(self.view[index].tolist())
        if start == 0 and stop << 3 >= len(self.packed):
            return self
        return TokenIds.from_bytes(self.packed[8 * start : 8 * max(start, stop)])

    def __iter__(self) -> Iterator[int]:
        return iter(self.view)

    def __reversed__(self) -> Iterator[int]:
        return reversed(self.view)

    def __contains__(self, value: object) -> bool:
        return value in self.view

    def index(self, value: Any, start: int = 0, stop: int = 2**62) -> int:
        return self.ids.index(value, start, stop)

    def count(self, value: Any) -> int:
        return self.ids.count(value)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenIds):
            return self.packed == other.packed
        if isinstance(other, tuple):
            return len(other) == len(self.packed) >> 3 and self.ids == other
        if isinstance(other, list):
            return len(other) == len(self.packed) >> 3 and self.view.tolist() == other
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self) -> int:
        return hash(self.ids)  # as the tuple's, which it equals

    def __add__(self, other: object) -> TokenIds | tuple[int, ...]:
        if isinstance(other, TokenIds):
            return TokenIds.from_bytes(self.packed + other.packed)
        if isinstance(other, tuple):
            return self.ids + other
        return NotImplemented

    def __radd__(self, other: object) -> tuple[int, ...]:
        if isinstance(other, tuple):
            return other + self.ids
        return NotImplemented

    def __repr__(self) -> str:
        return repr(self.ids)

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return _from_bytes, (self.packed,)  # pickle and copy rebuild it from its bytes


def _from_bytes(packed: bytes) -> TokenIds:
    return TokenIds.from_bytes(packed)


def eos_ids(eos_token_id: Any) -> frozenset[int]:
    """The end-of-sequence ids of a generation setting (an id, a list of them, a tensor, or None).

    >>> sorted(eos_ids([2, 7])), eos_ids(None), eos_ids(3)
    ([2, 7], frozenset(), frozenset({3}))
    """
    if eos_token_id is None:
        return frozenset()
    if hasattr(eos_token_id, "tolist"):  # a tensor
        eos_token_id = eos_token_id.tolist()
    if isinstance(eos_token_id, int):
        return frozenset((eos_token_id,))
    return frozenset(int(i) for i in eos_token_id)
