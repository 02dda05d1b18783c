"""HostPool: reusable host buffers for the host tier, page-locked when the model runs on CUDA.

Allocating page-locked memory (`pin_memory=True`) costs far more than the copy into it, so the
host tier takes its buffers from here: one byte buffer per moved entry, carved into the
entry's tensors. A buffer returns to the pool by itself when no tensor views it any more (its
storage's reference count, read on the next `take`); idle buffers beyond `max_idle_nbytes` are
freed. Sizes are rounded up to one of four steps per power of two, so a buffer serves entries
up to a quarter smaller than itself: page-locked host memory holds up to a quarter more than
the host tier counts. Pageable memory (a model on the CPU) is cheap to allocate and is not
pooled, so there the bytes held stay exactly the bytes counted.

Knows bytes and storages; nothing about tensors' meaning.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_MIN_NBYTES = 1 << 16


def size_class(nbytes: int) -> int:
    """The buffer size that serves `nbytes`: at least 64 KiB, else the next of 4 steps per power of two.

    >>> [size_class(n) for n in (1, 65_537, 100_000, 1 << 20)]
    [65536, 81920, 114688, 1048576]
    """
    if nbytes <= _MIN_NBYTES:
        return _MIN_NBYTES
    top = 1 << (nbytes - 1).bit_length()  # the power of two at or above
    step = top // 8  # between top/2 and top: top/2 + k * top/8
    return -(-nbytes // step) * step


def _views(buffer: torch.Tensor) -> bool:
    # The pool's own reference, and the storage object made here to read the count.
    return int(torch._C._storage_Use_Count(buffer.untyped_storage()._cdata)) > 2


class HostPool:
    """Byte buffers in host memory, reused once nothing views them.

    Args:
        pin: allocate page-locked buffers (needs CUDA).
        reuse: pool buffers (default: when pinned); without, every `take` allocates exactly `nbytes`.
        max_idle_nbytes: idle buffers kept for reuse at most; past it the largest idle ones are freed.
    """

    def __init__(self, pin: bool, reuse: bool | None = None, max_idle_nbytes: int = 1 << 30) -> None:
        self.pin = pin
        self.reuse = pin if reuse is None else reuse
        self.max_idle_nbytes = max_idle_nbytes
        self._buffers: dict[int, list[torch.Tensor]] = {}
        self._fences: dict[int, Callable[[], bool]] = {}  # by buffer address: has its last copy finished?
        self._addresses: set[int] = set()  # data pointers of the pooled buffers
        self.num_allocations = 0  # buffers allocated so far (for tests and benchmarks)

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` views one of the pool's buffers (which hold `size_class` bytes, not exactly theirs)."""
        return tensor.untyped_storage().data_ptr() in self._addresses

    def fence(self, tensor: torch.Tensor, done: Callable[[], bool]) -> None:
        """Keep `tensor`'s buffer out of reuse until `done()` (an asynchronous copy reads or writes it)."""
        self._fences[tensor.untyped_storage().data_ptr()] = done

    def _in_use(self, buffer: torch.Tensor) -> bool:
        if _views(buffer):
            return True
        ptr = buffer.untyped_storage().data_ptr()
        done = self._fences.get(ptr)
        if done is None:
            return False
        if done():
            del self._fences[ptr]
            return False
        return True

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of `nbytes` in a buffer nothing else views, reused when one is idle."""
        if not self.reuse:
            self.num_allocations += 1
            return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=self.pin)
        size = size_class(nbytes)
        for buffer in self._buffers.get(size, ()):
            if not self._in_use(buffer):
                return buffer[:nbytes]
        self._trim()
        buffer = torch.empty(size, dtype=torch.uint8, device="cpu", pin_memory=self.pin)
        self.num_allocations += 1
        self._buffers.setdefault(size, []).append(buffer)
        self._addresses.add(buffer.untyped_storage().data_ptr())
        return buffer[:nbytes]

    def idle_nbytes(self) -> int:
        """Bytes of buffers that nothing views now."""
        return sum(b.numel() for group in self._buffers.values() for b in group if not self._in_use(b))

    def _trim(self) -> None:
        idle = sorted(
            ((size, b) for size, group in self._buffers.items() for b in group if not self._in_use(b)),
            key=lambda pair: pair[0],
        )
        total = sum(size for size, _ in idle)
        while idle and total > self.max_idle_nbytes:
            size, buffer = idle.pop()
            self._buffers[size] = [b for b in self._buffers[size] if b is not buffer]
            self._addresses.discard(buffer.untyped_storage().data_ptr())
            total -= size
