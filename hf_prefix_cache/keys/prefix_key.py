"""PrefixKey: one row's request key, what the store matches a prompt against and stores a sequence under.

Built once per call by the hook that reads the call (`hooks/`), one per row: a batch is a
list of keys. The store never derives one; it matches, pins and stores by it. Imports nothing of
the package.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class PrefixKey:
    """The `namespace` (model, weights, salt, and whatever else the states depend on) and the row's tree `symbols`.

    `symbols` are token ids, with each media placeholder replaced by its item's content hash where
    the prompt holds media. `spans` are the media placeholder spans a restore never cuts inside;
    `item_spans` those whose item states (cross-attention keys, Mllama) restore with the prefix.

    >>> key = PrefixKey("ns", (5, 6, 7, 8))
    >>> key.prefix(2).symbols, key.prefix(2).namespace
    ((5, 6), 'ns')
    """

    namespace: str
    symbols: Sequence[Hashable]
    spans: Sequence[tuple[int, int]] = ()
    item_spans: Sequence[tuple[int, int]] = ()

    def prefix(self, length: int) -> PrefixKey:
        """The key of the first `length` symbols (spans kept: a restore clamps below them)."""
        return replace(self, symbols=self.symbols[:length])

    def with_symbols(self, symbols: Sequence[Hashable]) -> PrefixKey:
        """The same namespace and spans over other `symbols` (a row of the call, or its finished sequence)."""
        return replace(self, symbols=symbols)
