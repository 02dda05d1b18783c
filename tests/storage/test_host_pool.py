"""The host tier's buffers and batched copies: one buffer per moved entry, reused once nothing views it."""

from __future__ import annotations

import torch

from hf_prefix_cache.storage.host_pool import HostPool, size_class
from hf_prefix_cache.storage.mover import Mover


def test_size_classes_serve_every_size_within_a_quarter() -> None:
    """A size class is at least the size asked and at most a quarter larger (past the 64 KiB minimum)."""
    for n in [1, 65_536, 65_537, 99_999, 1 << 20, (1 << 20) + 1, 3 * (1 << 27) + 5]:
        size = size_class(n)
        assert size >= n
        assert n <= 1 << 16 or size <= n * 1.25 + 1


def test_a_pooled_buffer_is_reused_only_once_nothing_views_it() -> None:
    """A buffer in use is never handed out twice; once its views are gone the next take reuses it."""
    pool = HostPool(pin=False, reuse=True)
    a = pool.take(100_000)
    b = pool.take(100_000)
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    ptr = a.untyped_storage().data_ptr()
    del a
    c = pool.take(110_000)  # the same size class
    assert c.untyped_storage().data_ptr() == ptr
    assert pool.num_allocations == 2


def test_idle_buffers_beyond_the_limit_are_freed() -> None:
    """Idle pooled bytes stay within max_idle_nbytes once a new buffer is needed."""
    pool = HostPool(pin=False, reuse=True, max_idle_nbytes=1 << 17)
    held = [pool.take(1 << 16) for _ in range(4)]
    del held
    assert pool.idle_nbytes() == 4 << 16
    _ = pool.take(1 << 20)
    assert pool.idle_nbytes() <= 1 << 17


def test_an_unpooled_take_holds_exactly_the_bytes_asked() -> None:
    """Without reuse (pageable memory) a buffer is exactly the size asked, so held bytes are counted bytes."""
    pool = HostPool(pin=False)
    assert pool.take(12_345).untyped_storage().nbytes() == 12_345


def test_a_batched_move_round_trips_mixed_tensors_in_one_buffer() -> None:
    """to_host lays every tensor of a call out in one buffer; to_device copies them back exactly, Nones kept."""
    mover = Mover()
    keys = torch.randn(1, 2, 10, 4)
    tensors = [keys[..., 2:7, :], None, torch.arange(5), torch.randn(3, dtype=torch.float64), torch.ones(2).bool()]
    host, wait = mover.to_host(tensors)
    assert wait is None and host[1] is None
    present = [t for t in host if t is not None]
    assert len({t.untyped_storage().data_ptr() for t in present}) == 1
    assert present[0].untyped_storage().nbytes() <= sum(t.nbytes for t in present) + 8
    back = mover.to_device(host, [None] * len(host))
    for before, after in zip(tensors, back, strict=True):
        assert (before is None) == (after is None)
        if before is not None and after is not None:
            assert torch.equal(before, after) and after.dtype == before.dtype
            assert after.untyped_storage().data_ptr() != host[0].untyped_storage().data_ptr()  # type: ignore[union-attr]


def test_moving_back_tensors_of_several_buffers_copies_each() -> None:
    """Tensors that do not share one buffer come back one by one, exactly."""
    mover = Mover()
    tensors = [torch.randn(3), torch.randn(2, 2)]
    back = mover.to_device(tensors, [None, None])
    assert all(torch.equal(a, b) for a, b in zip(tensors, back, strict=True))  # type: ignore[arg-type]


def test_a_part_of_a_host_buffer_comes_back_without_the_rest() -> None:
    """Tensors with gaps between them in one host buffer come back one by one, holding only their own bytes."""
    mover = Mover()
    host, _ = mover.to_host([torch.randn(1, 1, 6, 2), torch.randn(1, 1, 6, 2)])
    parts = [t[..., :1, :] for t in host if t is not None]  # contiguous, but far apart in the buffer
    back = mover.to_device(parts, [None, None])
    for part, t in zip(parts, back, strict=True):
        assert t is not None and torch.equal(part, t)
        assert t.untyped_storage().nbytes() == t.nbytes


def test_a_fenced_buffer_is_not_reused_before_its_copy_ends() -> None:
    """A buffer whose views are gone but whose asynchronous copy has not finished is not handed out again."""
    pool = HostPool(pin=False, reuse=True)
    a = pool.take(1000)
    ptr = a.untyped_storage().data_ptr()
    finished = [False]
    pool.fence(a, lambda: finished[0])
    del a
    b = pool.take(1000)
    assert b.untyped_storage().data_ptr() != ptr
    finished[0] = True
    held = b
    assert pool.take(1000).untyped_storage().data_ptr() == ptr  # the copy ended: reused
    assert pool.num_allocations == 2 and held is b
