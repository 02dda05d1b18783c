"""Run: the key/value tensors a working cache's attention layers hand the store, held by reference or packed.

A `Run` owns the key/value tensors of consecutive positions `[lo, hi)` of one sequence, for every
layer that has keys; stored segments read ranges of it (`storage/segments.py`) and count themselves
with `take` and `give_back`. `pack` lays many tensors out in one stack per device, dtype and shape
(a run's packed copy), and `all_finite` checks what such stacks hold in a few reductions.

Knows nothing about the tree or the store.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.model.landing import Landing


class Run:
    """Keys/values `[B, H, hi - lo, D]` per attention layer (None for layers without keys).

    A run made from one stack (`WorkingCache.capture`'s copy of the new positions) makes its per-layer
    views of the stack only when `keys` or `values` is first read: a copy the placement drops (its prefix
    moved onto the whole run) or never reads again costs no view per layer.

    `devices` remembers where each layer's tensors belong, so a run brought back from host
    memory or disk goes to the device of its own layer (models split over several devices).
    `wait`, when set, blocks until an asynchronous copy into these tensors has finished;
    `landing`, when set, tells when copies into them (layer by layer, from host memory) have
    landed: `slice` waits for all of them unless the caller waits per layer itself.

    Its lifetime is counted here and only here: each stored segment that reads it holds one
    reference (`take`), returned with `give_back`; `num_refs` is the count, for reading only
    (a plain attribute: the placement reads it on every insert, and a property would be a call).

    >>> run = Run([torch.zeros(1, 1, 4, 2)], [torch.zeros(1, 1, 4, 2)], 0, 4)
    >>> run.take(); run.take(); run.give_back(2, 4)  # the segment reading [2, 4) leaves
    >>> run.num_refs, (run.lo, run.hi)
    (1, (0, 2))
    """

    __slots__ = (
        "_keys",
        "_packed",
        "_values",
        "_views",
        "buffers",
        "devices",
        "hi",
        "landing",
        "lo",
        "nbytes_per_token",
        "num_refs",
        "wait",
    )

    def __init__(
        self,
        keys: list[torch.Tensor | None],
        values: list[torch.Tensor | None],
        lo: int,
        hi: int,
        devices: list[torch.device | None] | None = None,
        nbytes_per_token: int | None = None,
    ) -> None:
        self._keys: list[torch.Tensor | None] | None = keys
        self._values: list[torch.Tensor | None] | None = values
        self._packed: tuple[torch.Tensor, tuple[int, ...], int] | None = None
        self.lo = lo
        self.hi = hi
        self.num_refs = 0  # stored segments reading this run: changed only by `take` and `give_back`
        self.wait: Callable[[], None] | None = None
        self.landing: Landing | None = None
        self.buffers: list[torch.Tensor] = []  # set by `packed_copy`: tensors holding exactly its keys and values
        self._views: tuple[int, int, list[torch.Tensor | None], list[torch.Tensor | None]] | None = None
        # One pass over the layers: each key's length checked, its device and (unless given) its bytes read.
        span, total = hi - lo, 0
        found: list[torch.device | None] = []  # filled unless `devices` is given
        fill = devices is None
        for k in keys:
            if k is not None:
                if k.shape[-2] != span:
                    raise InconsistentStateError(f"run [{lo}, {hi}) given keys of {k.shape[-2]} positions")
                if nbytes_per_token is None:
                    total += k.nbytes
            if fill:
                found.append(None if k is None else k.device)
        if nbytes_per_token is None:
            for v in values:
                if v is not None:
                    total += v.nbytes
            nbytes_per_token = total // max(span, 1)
        self.devices = found if devices is None else devices
        self.nbytes_per_token = nbytes_per_token

    @property
    def keys(self) -> list[torch.Tensor | None]:
        """Each layer's keys (None for layers without keys)."""
        keys = self._keys
        return keys if keys is not None else self._unpack()[0]

    @keys.setter
    def keys(self, keys: list[torch.Tensor | None]) -> None:
        self._keys = keys

    @property
    def values(self) -> list[torch.Tensor | None]:
        """Each layer's values (None for layers without keys)."""
        values = self._values
        return values if values is not None else self._unpack()[1]

    @values.setter
    def values(self, values: list[torch.Tensor | None]) -> None:
        self._values = values

    def _unpack(self) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Make the per-layer views of a run made from one stack (`packed`); what was set since stays."""
        assert self._packed is not None, "a run without keys or values"
        stack, kv_layers, num_layers = self._packed
        copies = stack.unbind(0)
        num_kv = len(kv_layers)
        keys: list[torch.Tensor | None]
        values: list[torch.Tensor | None]
        if num_kv == num_layers:
            keys, values = list(copies[:num_kv]), list(copies[num_kv:])
        else:  # layers without keys keep their None
            keys, values = [None] * num_layers, [None] * num_layers
            for j, i in enumerate(kv_layers):
                keys[i], values[i] = copies[j], copies[num_kv + j]
        if self._keys is None:
            self._keys = keys
        if self._values is None:
            self._values = values
        self._packed = None
        return self._keys, self._values

    @classmethod
    def packed(
        cls,
        stack: torch.Tensor,
        kv_layers: tuple[int, ...],
        num_layers: int,
        lo: int,
        hi: int,
        devices: list[torch.device | None],
        nbytes_per_token: int,
    ) -> Run:
        """A run whose keys and values are `stack`: the keys of the `kv_layers` (of `num_layers`), then their values.

        Its per-layer views are made when first read. `stack` is its one buffer (`buffers`).

        >>> stack = torch.arange(8.0).view(2, 1, 1, 2, 2)  # one layer: its keys, then its values
        >>> run = Run.packed(stack, (0,), 1, 3, 5, [torch.device("cpu")], 16)
        >>> run.keys[0].tolist(), run.values[0].shape
        ([[[[0.0, 1.0], [2.0, 3.0]]]], torch.Size([1, 1, 2, 2]))
        """
        if stack.shape[0] != 2 * len(kv_layers):
            raise InconsistentStateError(f"a stack of {stack.shape[0]} for {len(kv_layers)} layers")
        run = cls.checked([], [], lo, hi, devices, nbytes_per_token)
        run._keys = run._values = None  # made from the stack when first read (`_unpack`)
        run._packed, run.buffers = (stack, kv_layers, num_layers), [stack]
        return run

    @property
    def nbytes(self) -> int:
        return self.nbytes_per_token * (self.hi - self.lo)

    def take(self) -> None:
        """One more stored segment reads this run (a new one, or one of the two a split makes)."""
        self.num_refs += 1

    def give_back(self, start: int, end: int) -> None:
        """The segment reading `[start, end)` of this run no longer does.

        A run still read by others is cut down to what they cover, so held bytes stay equal to
        counted bytes: the part given back is its head or tail (runs are laid along a path and
        segments leave bottom-up). A run read by none is left to be freed with its last holder.
        """
        self.num_refs -= 1
        if self.num_refs > 0:
            if end == self.hi:
                self.compact(self.lo, start)
            elif start == self.lo:
                self.compact(end, self.hi)

    def slice(
        self, start: int, end: int, land: bool = True
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Views of positions `[start, end)` (the views of the last range asked for are kept and handed out again:
        a prefix hit by many requests slices its layers once; nothing writes into a stored tensor).

        With `land=False` copies still landing are not waited for: the caller must call
        `landing.ready(layer)` before it reads a layer (a restore that overlaps the prefill).
        """
        if not self.lo <= start <= end <= self.hi:
            raise InconsistentStateError(f"[{start}, {end}) outside run [{self.lo}, {self.hi})")
        if self.wait is not None or (land and self.landing is not None):
            self._land(land)
        views = self._views
        if views is None or views[0] != start or views[1] != end:
            a, b = start - self.lo, end - self.lo
            keys: list[torch.Tensor | None] = []
            values: list[torch.Tensor | None] = []
            for k, v in zip(self.keys, self.values, strict=True):
                keys.append(k[..., a:b, :] if k is not None else None)
                values.append(v[..., a:b, :] if v is not None else None)
            views = self._views = (start, end, keys, values)
        return list(views[2]), list(views[3])

    def _land(self, land: bool) -> None:
        """Wait for an asynchronous copy into these tensors, and (with `land`) for every copy still landing."""
        if self.wait is not None:
            self.wait()
            self.wait = None
        if land and self.landing is not None:
            self.landing.ready_all()
            if self.landing.landed:
                self.landing = None

    def compact(self, lo: int, hi: int, copy: Run | None = None) -> None:
        """Keep only `[lo, hi)`, copied out (`packed_copy`) so the rest is freed.

        `copy`, when it holds exactly `[lo, hi)` (a packed copy made already), is kept instead of a new one.
        """
        self._adopt(copy if copy is not None and (copy.lo, copy.hi) == (lo, hi) else self.packed_copy(lo, hi))

    def packed_copy(self, lo: int, hi: int) -> Run:
        """A new run holding contiguous copies of `[lo, hi)`, laid out in one new buffer per device, dtype and shape.

        Tensors of one shape (every layer's keys and values, usually) are stacked by one kernel and
        the copies are views of the stack: a view per tensor and two calls into torch, however many
        layers there are. The run's `buffers` are those stacks, which hold its keys and values and
        nothing else: a check of every value (`all_finite`) reads them as a few tensors instead of
        one view per layer.

        >>> run = Run([torch.arange(8.0).view(1, 1, 4, 2)], [torch.ones(1, 1, 4, 2)], 0, 4)
        >>> copy = run.packed_copy(1, 3)
        >>> torch.equal(copy.keys[0], run.keys[0][..., 1:3, :]), copy.keys[0].is_contiguous(), len(copy.buffers)
        (True, True, 1)
        >>> copy.keys[0].untyped_storage().data_ptr() == copy.values[0].untyped_storage().data_ptr()
        True
        """
        if not self.lo <= lo <= hi <= self.hi:
            raise InconsistentStateError(f"[{lo}, {hi}) outside run [{self.lo}, {self.hi})")
        if self.wait is not None or self.landing is not None:
            self._land(True)
        a, span = lo - self.lo, hi - lo
        tensors = [*self.keys, *self.values]
        views = [t.narrow(-2, a, span) for t in tensors if t is not None]
        copies, stacks = pack(views)
        if len(views) != len(tensors):  # layers without keys keep their None
            made = iter(copies)
            copies = [None if t is None else next(made) for t in tensors]
        num_layers = len(self.keys)
        run = Run.checked(copies[:num_layers], copies[num_layers:], lo, hi, list(self.devices), self.nbytes_per_token)
        run.buffers = stacks
        return run

    @classmethod
    def checked(
        cls,
        keys: list[torch.Tensor | None],
        values: list[torch.Tensor | None],
        lo: int,
        hi: int,
        devices: list[torch.device | None],
        nbytes_per_token: int,
    ) -> Run:
        """A run of tensors whose lengths (`hi - lo` positions each), devices and bytes the caller has worked out.

        No pass over the layers, as `Run(...)` makes: for callers that have just made each tensor.
        """
        run = cls.__new__(cls)
        run._keys, run._values, run._packed, run.lo, run.hi = keys, values, None, lo, hi
        run.num_refs, run.wait, run.landing, run.buffers, run._views = 0, None, None, [], None
        run.devices, run.nbytes_per_token = devices, nbytes_per_token
        return run

    def _adopt(self, other: Run) -> None:
        """Hold `other`'s tensors and range instead of this run's own (a copy of part of it); references stay."""
        if not self.lo <= other.lo <= other.hi <= self.hi:
            raise InconsistentStateError(f"[{other.lo}, {other.hi}) outside [{self.lo}, {self.hi})")
        self._keys, self._values, self._packed = other._keys, other._values, other._packed  # views unmade stay so
        self.lo, self.hi, self.buffers, self._views = other.lo, other.hi, other.buffers, None


def stack_one(views: list[torch.Tensor], same_dtype: bool = False) -> torch.Tensor | None:
    """`views` stacked by one call, or None where they cannot share one stack (several dtypes, shapes or devices).

    The dtype is checked here (`stack` would promote mixed ones) unless the caller says it checked
    (`same_dtype`); `stack` itself refuses several shapes or devices.
    """
    if not views or not (same_dtype or len({v.dtype for v in views}) == 1):
        return None
    try:
        with torch.no_grad():
            return torch.stack(views)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError:  # several shapes or devices
        return None


def pack(views: list[torch.Tensor], same_dtype: bool = False) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
    """Contiguous copies of `views` (in their order) and the stacks that hold them, one per device, dtype and shape.

    One stack where they can share it (`stack_one`); otherwise grouped.

    >>> copies, stacks = pack([torch.ones(2, 3)[:, :1], torch.zeros(2, 1), torch.ones(4)])
    >>> [tuple(c.shape) for c in copies], [tuple(s.shape) for s in stacks]
    ([(2, 1), (2, 1), (4,)], [(2, 2, 1), (1, 4)])
    """
    stack = stack_one(views, same_dtype)
    if stack is not None:
        return list(stack.unbind(0)), [stack]
    groups: dict[tuple[torch.device, torch.dtype, torch.Size], tuple[list[int], list[torch.Tensor]]] = {}
    for i, t in enumerate(views):
        where = (t.device, t.dtype, t.shape)
        group = groups.get(where)
        if group is None:
            groups[where] = ([i], [t])
        else:
            group[0].append(i)
            group[1].append(t)
    copies: list[torch.Tensor | None] = [None] * len(views)
    stacks: list[torch.Tensor] = []
    with torch.no_grad():
        for members, same in groups.values():
            stack = torch.stack(same)
            stacks.append(stack)
            for i, copy in zip(members, stack.unbind(0), strict=True):
                copies[i] = copy
    return copies, stacks


def all_finite(tensors: Iterable[torch.Tensor | None]) -> bool:
    """Whether every floating-point tensor of `tensors` holds only finite values (meta tensors hold none).

    The checks run on each tensor's own device and are reduced there, so a device costs one
    synchronisation however many tensors it holds; a device holding one tensor (a packed copy's
    stack) costs one reduction and that read.

    >>> all_finite([torch.ones(2), torch.tensor([0.0, float("nan")])])
    False
    >>> all_finite([torch.ones(2, dtype=torch.float64), torch.ones(3, dtype=torch.bfloat16)])
    True
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        if t is not None and t.numel() and (t.is_floating_point() or t.is_complex()) and not t.is_meta:
            t = torch.view_as_real(t) if t.is_complex() else t
            group = groups.get((t.device, t.dtype))
            if group is None:
                groups[t.device, t.dtype] = [t]
            else:
                group.append(t)
    per_device: dict[torch.device, list[torch.Tensor]] = {}
    for (device, dtype), members in groups.items():
        # One reduction per group, accumulated in float32 (float64 for float64 states, never narrowed): a NaN
        # anywhere makes it NaN, an infinity makes it infinite or NaN (opposite infinities), and finite values
        # make it finite unless they add up beyond float32's range (magnitudes near 1e38, not stored either).
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        # Several tensors: the sums of their magnitudes, in one dispatch.
        sums = [members[0].sum(dtype=wide)] if len(members) == 1 else list(torch._foreach_norm(members, 1, dtype=wide))
        held = per_device.get(device)
        if held is None:
            per_device[device] = sums
        else:
            held.extend(sums)
    for sums in per_device.values():
        total = sums[0] if len(sums) == 1 else torch.stack(sums).sum()
        if not math.isfinite(total.item()):
            return False
    return True
