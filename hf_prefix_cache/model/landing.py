"""Landing: copies into a run that may still be on their way, and waiting for one layer's share of them.

A run brought back from host memory is copied to the device layer block by layer block. The
prefill need not wait for all of it: layer `i` only has to wait for the block that holds layer
`i`, just before its first use (`WorkingCache` does that in `update`), so the copies of later
layers overlap the compute of earlier ones. Two kinds, with one interface:

- `DeferredCopies` (any device, what the CPU runs): each block's copy is a function, run at the
  first `ready` that needs it. A reader that forgets to wait finds unwritten memory, so CPU
  tests catch a missing wait the way a GPU would show it.
- `StreamEvents` (CUDA): the copies run on a side stream; each block records an event, and
  `ready` makes the reader's current stream wait for it (no host sync).

Knows tensors and streams; nothing about trees or models.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch


class Landing:
    """Per-layer readiness of copies into a run.

    `block_of[layer]` is the copy block that holds `layer`'s tensors (layers without tensors
    in the run are absent and always ready).
    """

    def __init__(self, block_of: dict[int, int]) -> None:
        self.block_of = block_of

    def ready(self, layer: int) -> None:
        """Make `layer`'s tensors safe to read for what the caller does next."""
        block = self.block_of.get(layer)
        if block is not None:
            self._ready_block(block)

    def ready_all(self) -> None:
        """Make every tensor of the run safe to read for what the caller does next."""
        raise NotImplementedError

    @property
    def landed(self) -> bool:
        """Whether every copy has finished, so nobody needs to wait any more."""
        raise NotImplementedError

    def _ready_block(self, block: int) -> None:
        raise NotImplementedError


class DeferredCopies(Landing):
    """Copies done at the first `ready` that needs them (thread-safe: a second reader waits for the first).

    >>> src, dst = torch.arange(4.0), torch.full((4,), float("nan"))
    >>> landing = DeferredCopies({0: 0, 1: 1}, [lambda: dst[:2].copy_(src[:2]), lambda: dst[2:].copy_(src[2:])])
    >>> landing.ready(0); dst.tolist()[:2], landing.landed
    ([0.0, 1.0], False)
    >>> landing.ready_all(); dst.tolist(), landing.landed
    ([0.0, 1.0, 2.0, 3.0], True)
    """

    def __init__(self, block_of: dict[int, int], copies: Sequence[Callable[[], object]]) -> None:
        super().__init__(block_of)
        self._copies: list[Callable[[], object] | None] = list(copies)
        self._left = len(copies)
        self._lock = threading.Lock()
        self.order: list[int] = []  # blocks in the order they were copied (for tests)

    def _ready_block(self, block: int) -> None:
        if self._copies[block] is None:
            return
        with self._lock:
            copy = self._copies[block]
            if copy is not None:
                with torch.no_grad():
                    copy()
                self._copies[block] = None
                self._left -= 1
                self.order.append(block)

    def ready_all(self) -> None:
        for block in range(len(self._copies)):
            self._ready_block(block)

    @property
    def landed(self) -> bool:
        return self._left == 0


class StreamEvents(Landing):  # pragma: no cover - CUDA only
    """Copies already queued on a side stream of `device`, one event recorded after each block.

    `ready` queues a wait on the caller's current stream; the host does not block. The events
    stay until the last one has completed (a wait on a completed event costs nothing), so a
    reader on any stream can still order itself after them.
    """

    def __init__(self, block_of: dict[int, int], device: torch.device, events: Sequence[torch.cuda.Event]) -> None:
        super().__init__(block_of)
        self.device = device
        self.events = list(events)

    def _ready_block(self, block: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.events[block])

    def ready_all(self) -> None:
        # One stream runs the blocks in order: its last event follows every copy.
        torch.cuda.current_stream(self.device).wait_event(self.events[-1])

    @property
    def landed(self) -> bool:
        return bool(self.events[-1].query())  # type: ignore[no-untyped-call]


class Landings(Landing):
    """Several landings read as one (a run whose layers lie on several devices).

    >>> a, b = DeferredCopies({0: 0}, [lambda: None]), DeferredCopies({1: 0}, [lambda: None])
    >>> both = Landings([a, b]); both.ready(1); (a.landed, b.landed, both.landed)
    (False, True, False)
    """

    def __init__(self, parts: Sequence[Landing]) -> None:
        super().__init__({})
        self.parts = list(parts)

    def ready(self, layer: int) -> None:
        for part in self.parts:
            part.ready(layer)

    def ready_all(self) -> None:
        for part in self.parts:
            part.ready_all()

    @property
    def landed(self) -> bool:
        return all(part.landed for part in self.parts)


def combine(landings: Sequence[Landing]) -> Landing | None:
    """One landing for all of `landings` (None for none)."""
    if not landings:
        return None
    return landings[0] if len(landings) == 1 else Landings(landings)


def land_all(landings: Sequence[Landing]) -> None:
    """`ready_all` on each of `landings`."""
    for landing in landings:
        landing.ready_all()
