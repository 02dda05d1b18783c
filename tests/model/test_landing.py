"""Landings: a block's copy runs once, and whoever asks for it finds it finished."""

from __future__ import annotations

import threading
import time

import torch

from hf_prefix_cache.model.landing import DeferredCopies, Landings, combine


def test_a_second_reader_waits_for_the_copy_the_first_one_started() -> None:
    """While one thread copies a block, another asking for it blocks until the copy is complete."""
    src, dst = torch.arange(8.0), torch.full((8,), float("nan"))
    runs: list[int] = []

    def slow_copy() -> None:
        runs.append(0)
        dst[:4].copy_(src[:4])
        time.sleep(0.05)  # the second reader arrives in the middle
        dst[4:].copy_(src[4:])

    landing = DeferredCopies({0: 0}, [slow_copy])
    first = threading.Thread(target=landing.ready, args=(0,))
    first.start()
    time.sleep(0.01)
    landing.ready(0)
    seen = dst.clone()  # read as soon as `ready` returned
    first.join()
    assert torch.equal(seen, src) and runs == [0] and landing.landed


def test_many_readers_copy_every_block_exactly_once() -> None:
    src = torch.arange(64.0)
    dst = torch.full((64,), float("nan"))
    calls = [0] * 16

    def copy(block: int) -> None:
        calls[block] += 1
        dst[4 * block : 4 * block + 4].copy_(src[4 * block : 4 * block + 4])

    landing = DeferredCopies({layer: layer // 2 for layer in range(32)}, [lambda b=b: copy(b) for b in range(16)])
    readers = [threading.Thread(target=landing.ready_all) for _ in range(6)]
    readers += [threading.Thread(target=landing.ready, args=(layer,)) for layer in range(0, 32, 3)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    assert calls == [1] * 16 and torch.equal(dst, src) and landing.landed


def test_layers_without_tensors_are_always_ready() -> None:
    landing = DeferredCopies({3: 0}, [lambda: None])
    landing.ready(0)  # not a layer of the run: nothing to wait for
    assert not landing.landed and landing.order == []


def test_combine_reads_several_landings_as_one() -> None:
    a, b = DeferredCopies({0: 0}, [lambda: None]), DeferredCopies({1: 0}, [lambda: None])
    assert combine([]) is None and combine([a]) is a
    both = combine([a, b])
    assert isinstance(both, Landings)
    both.ready_all()
    assert a.landed and b.landed and both.landed
