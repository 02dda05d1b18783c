"""EncoderOutputs: a byte-bounded store of encoder outputs, keyed by model namespace and input hash.

For encoder-decoder models (Whisper, BART, T5, Florence-2, ...) the encoder is most of the
work of a short answer. A request whose encoder input (its content hash, `media.hash_media`) was seen before under the
same model namespace (weights, dtype, adapters, salt) gets the stored output and skips the
encoder; any other input, or another namespace, finds nothing. Outputs are held by reference
(the encoder made them; nothing writes into them) on the device they were computed on, and
counted by their bytes: past `max_bytes` the least recently used go first, and an output
larger than the budget is not kept. A request still using an output that was just dropped
keeps it alive until it finishes.

Knows nothing about models, the tree or `generate`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch


class EncoderOutputs:
    """Least-recently-used encoder outputs within `max_bytes` (0 keeps none).

    Thread-safe. `nbytes` is the sum of the stored tensors' bytes; `hits` counts `get` calls
    that found an output.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"the encoder-output budget cannot be negative, got {max_bytes}")
        self._max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, int], torch.Tensor] = OrderedDict()
        self._nbytes = 0
        self._lock = threading.Lock()
        self.hits = 0

    @property
    def max_bytes(self) -> int:
        """The byte budget (settable; shrinking drops the least recently used outputs at once)."""
        return self._max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int) -> None:
        if value < 0:
            raise ValueError(f"the encoder-output budget cannot be negative, got {value}")
        with self._lock:
            self._max_bytes = value
            self._shrink(0)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def get(self, namespace: str, digest: int) -> torch.Tensor | None:
        """The output stored for input `digest` under `namespace`, or None; marks it recently used."""
        key = (namespace, digest)
        with self._lock:
            hidden = self._entries.get(key)
            if hidden is not None:
                self._entries.move_to_end(key)
                self.hits += 1
            return hidden

    def put(self, namespace: str, digest: int, hidden: torch.Tensor) -> bool:
        """Keep `hidden` for input `digest`; False when it alone exceeds the budget (nothing kept)."""
        nbytes = _held_nbytes(hidden)
        key = (namespace, digest)
        with self._lock:
            if nbytes > self._max_bytes:
                return False
            old = self._entries.pop(key, None)
            if old is not None:
                self._nbytes -= _held_nbytes(old)
            self._shrink(nbytes)
            self._entries[key] = hidden
            self._nbytes += nbytes
            return True

    def clear(self) -> None:
        """Drop every stored output."""
        with self._lock:
            self._entries.clear()
            self._nbytes = 0

    def _shrink(self, room: int) -> None:
        """Drop least recently used outputs until `room` more bytes fit (under the lock)."""
        while self._entries and self._nbytes + room > self._max_bytes:
            _, old = self._entries.popitem(last=False)
            self._nbytes -= _held_nbytes(old)


def _held_nbytes(t: torch.Tensor) -> int:
    """Bytes `t` keeps alive: its whole storage (a view of a larger tensor holds all of it)."""
    return max(t.untyped_storage().nbytes(), t.nbytes)
