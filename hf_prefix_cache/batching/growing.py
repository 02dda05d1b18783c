"""GrowingCache: the running batch's working cache, whose full-attention layers live in buffers with room.

transformers' `DynamicLayer.update` concatenates every step: the whole batch's keys and values are copied
to take one new column, which on a CPU costs more than the attention that reads them (44% of a 4-row
SmolLM2 step at 1,500 tokens). Here a plain full-attention layer (exactly `DynamicLayer`) lives in a
`Room`: buffers `[capacity, heads, columns, dim]` of which the layer's `keys` and `values` are views
(rows `[0, rows)`, columns `[start, stop)`), so a step writes its column in place, and the buffers are
copied only when outgrown (`SPARE` columns at a time). Every other layer (sliding windows, recurrent
states) updates as transformers does. The layers' contents, and so every logit, are those a
concatenation gives.

Where every cached layer is plain full attention (`ModelProfile.defers_keys`: Llama, Qwen, Mistral
without windows, ...) the batch's rows join and leave in the rooms too (`lays_out_in_place`): a joining
row is copied alone into the next free row (a longer one first widens every row's left padding into the
`LEFT_SPARE` columns before `start`), a leaving row's place takes the last row (one row copied), and the
padding columns every row shares are dropped by moving `start`. Without this each join and each leave
copied the whole batch (about 130 ms each at 8 rows of 1,600 SmolLM2 tokens on one CPU thread, a step's
worth). Padding columns hold zeros, as the full copies wrote them.

Example:
    >>> from hf_prefix_cache.api.prefix_cache import store_of
    >>> cache = GrowingCache(store_of(store).profile)
    >>> _ = model(ids, past_key_values=cache, use_cache=True)
    >>> _ = model(ids[:, :1], past_key_values=cache, use_cache=True)
    >>> cache.layers[0].keys.shape[-2], cache.spare(0) == SPARE
    (37, True)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import DynamicLayer

from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.model.working_cache import WorkingCache

if TYPE_CHECKING:
    from hf_prefix_cache.batching.packed import Packing
    from hf_prefix_cache.model.profile import ModelProfile

#: Spare columns after the last: a layer's buffers are copied once per this many steps at most.
SPARE = 64
#: Spare columns before the first, made when the batch's buffers are: a row up to this much longer than the
#: batch joins without the batch being copied.
LEFT_SPARE = 256
#: Rows a batch's buffers are first made for (then twice as many each time they are outgrown: a batch that
#: grows to N rows is copied about log2(N) times, and holds at most twice the rows' memory).
FIRST_ROWS = 1


class Room:
    """One layer's keys and values buffers; the layer holds views of rows `[0, rows)`, columns `[start, stop)`."""

    __slots__ = ("keys", "rows", "start", "stop", "values")

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: int, start: int, stop: int) -> None:
        self.keys, self.values, self.rows, self.start, self.stop = keys, values, rows, start, stop

    @classmethod
    def around(cls, keys: torch.Tensor, values: torch.Tensor, rows: int, before: int, after: int) -> Room:
        """A room holding copies of `keys`/`values` `[n, heads, length, dim]`, for `rows` rows (at least n),
        with `before` spare columns before them and `after` after."""
        n, length = keys.shape[0], keys.shape[-2]
        columns = before + length + after
        room = cls(
            keys.new_empty((max(rows, n), keys.shape[1], columns, keys.shape[-1])),
            values.new_empty((max(rows, n), values.shape[1], columns, values.shape[-1])),
            n,
            before,
            before + length,
        )
        room.keys[:n, :, before : before + length] = keys
        room.values[:n, :, before : before + length] = values
        return room

    def views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values: the filled rows and columns."""
        return (
            self.keys[: self.rows, :, self.start : self.stop],
            self.values[: self.rows, :, self.start : self.stop],
        )

    def holds(self, keys: torch.Tensor | None, values: torch.Tensor | None) -> bool:
        """Whether `keys` and `values` are this room's views (nothing replaced them since)."""
        if keys is None or values is None:
            return False
        mine = self.views()
        return all(
            t.data_ptr() == m.data_ptr() and t.shape == m.shape and t.stride() == m.stride()
            for t, m in zip((keys, values), mine, strict=True)
        )

    def regrown(self, rows: int, before: int, after: int) -> Room:
        """A copy with room for `rows` rows, `before` spare columns before and `after` after."""
        return Room.around(*self.views(), rows, before, after)

    def write(self, row: int | slice, first: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write `[heads, n, dim]` keys and values into `row` from column `first` (of the filled columns)."""
        at = self.start + first
        self.keys[row, :, at : at + keys.shape[-2]] = keys
        self.values[row, :, at : at + values.shape[-2]] = values

    def zero(self, rows: slice | int, first: int, stop: int) -> None:
        """Zero `rows` at filled columns `[first, stop)` (padding)."""
        self.keys[rows, :, self.start + first : self.start + stop] = 0
        self.values[rows, :, self.start + first : self.start + stop] = 0


class GrowingCache(WorkingCache):
    """A `WorkingCache` whose plain full-attention layers grow in place (see the module's docstring)."""

    def __init__(self, profile: ModelProfile) -> None:
        super().__init__(profile)
        self._rooms: dict[int, Room] = {}  # by layer
        self.packing: Packing | None = None  # set for one packed step (`packed.py`): where its tokens go

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As `Cache.update`; a plain full-attention layer writes the new columns into its room."""
        layer = self.layers[layer_idx]
        if self.packing is not None:
            return self._packed_update(key_states, value_states, layer_idx)
        old_keys, old_values = _kv(layer)
        if type(layer) is not DynamicLayer or not layer.is_initialized or old_keys is None or old_values is None:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        new = key_states.shape[-2]
        room = self._rooms.get(layer_idx)
        if room is None or not room.holds(old_keys, old_values):
            room = Room.around(old_keys, old_values, old_keys.shape[0], 0, new + SPARE)
        elif room.stop + new > room.keys.shape[-2]:
            room = room.regrown(room.keys.shape[0], room.start, new + SPARE)
        self._rooms[layer_idx] = room
        room.write(slice(None, room.rows), room.stop - room.start, key_states, value_states)
        room.stop += new
        layer.keys, layer.values = room.views()
        return layer.keys, layer.values

    def _packed_update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A packed step's update (`packed.py`): `[1, heads, T, dim]` holds each decoding row's one column, then each
        joining row's new positions; every row's go to its room row, ending at the step's column."""
        packing, layer, room = self.packing, self.layers[layer_idx], self._rooms.get(layer_idx)
        if packing is None or room is None or not isinstance(layer, DynamicLayer) or not room.holds(*_kv(layer)):
            raise InconsistentStateError(f"layer {layer_idx}: a packed step needs every cached layer in its room")
        if room.rows != packing.decoding + len(packing.joining):
            raise InconsistentStateError(f"layer {layer_idx}: {room.rows} rows, the packed step lays out others")
        if room.stop + 1 > room.keys.shape[-2]:
            room = self._rooms[layer_idx] = room.regrown(room.keys.shape[0], room.start, 1 + SPARE)
        at, decoding = room.stop - room.start, packing.decoding
        if decoding:
            room.write(
                slice(0, decoding),
                at,
                key_states[0, :, :decoding].transpose(0, 1).unsqueeze(2),
                value_states[0, :, :decoding].transpose(0, 1).unsqueeze(2),
            )
        for i, joiner in enumerate(packing.joining):
            span = slice(joiner.offset, joiner.offset + joiner.new)
            room.write(decoding + i, at + 1 - joiner.new, key_states[0, :, span], value_states[0, :, span])
        room.stop += 1
        layer.keys, layer.values = room.views()
        return layer.keys, layer.values

    def spare(self, layer_idx: int) -> int:
        """Columns layer `layer_idx`'s room can still take after its last before it is copied (0 where it has none)."""
        room = self._rooms.get(layer_idx)
        layer = self.layers[layer_idx]
        if room is None or not room.holds(*_kv(layer)):
            return 0
        return room.keys.shape[-2] - room.stop

    # ------------------------------------------------------------------ the batch's rows, in place
    def lays_out_in_place(self) -> bool:
        """Whether rows join and leave in the rooms: every cached layer plain full attention, each in its room
        (or none set yet: an empty batch)."""
        if not self.profile.defers_keys:
            return False
        kv = self.profile.kv_layers
        if not any(i in self._rooms for i in kv):
            return all(not getattr(self.layers[i], "is_initialized", False) for i in kv)
        return all(i in self._rooms and self._rooms[i].holds(*_kv(self.layers[i])) for i in kv)

    def add_row(self, row: WorkingCache, row_len: int, gap: int = 0, rows: int = 0) -> None:
        """Append `row`'s first `row_len` positions as the last row, right-aligned behind zeros (and `gap` columns of
        zeros after them, which a row joining in a packed step fills: `packed.py`); a row longer than the batch first
        widens every row's padding (in the spare columns before, or by one copy). `rows`: how many rows the batch
        will hold once the rows joining with this one are in, so that buffers which must grow grow once for them
        all (7 rows joining one: one copy of the batch instead of three)."""
        row.land()
        for i in self.profile.kv_layers:
            keys, values = _kv(row.layers[i])
            if keys is None or values is None or keys.shape[-2] < row_len:
                raise InconsistentStateError(f"layer {i}: a joining row holds no keys for its {row_len} positions")
            keys, values = keys[..., :row_len, :], values[..., :row_len, :]
            room = self._rooms.get(i)
            if room is None:
                room = Room.around(keys, values, max(FIRST_ROWS, rows), LEFT_SPARE, SPARE + gap)
                room.zero(0, row_len, row_len + gap)
                room.stop += gap
            else:
                width = room.stop - room.start
                wider = max(0, row_len + gap - width)
                full = room.rows == room.keys.shape[0]
                if full or wider > room.start:
                    before = room.start if wider <= room.start else wider + LEFT_SPARE
                    after = max(SPARE, room.keys.shape[-2] - room.stop)
                    capacity = max(room.rows * 2, rows) if full else room.keys.shape[0]
                    room = room.regrown(capacity, before, after)
                if wider:
                    room.start -= wider
                    room.zero(slice(None, room.rows), 0, wider)
                pad = room.stop - room.start - row_len - gap
                room.zero(room.rows, 0, pad)
                room.write(room.rows, pad, keys[0], values[0])
                room.zero(room.rows, pad + row_len, pad + row_len + gap)
                room.rows += 1
            self._rooms[i] = room
        self._set_views()

    def row_view(self, row: int, start: int, end: int) -> WorkingCache:
        """A one-row cache viewing columns `[start, end)` of `row` (no copy: read it before the batch moves on, and
        never let anything keep it: store it with `insert_sequence(..., row=0)`, which copies what it keeps)."""
        out = WorkingCache(self.profile)
        for i, room in self._rooms.items():
            keys, values = room.views()
            k, v = keys[row : row + 1, :, start:end], values[row : row + 1, :, start:end]
            self.profile.adapters[i].restore_kv(out.layers[i], k, v, end - start)
        out.count_linear(end - start)
        return out

    def same_positions(self, a: int, a_start: int, b: int, b_start: int, n: int) -> bool:
        """Whether rows `a` and `b` hold equal keys and values (every element) over `n` positions from their columns
        `a_start` and `b_start`, in every layer."""
        for room in self._rooms.values():
            keys, values = room.views()
            for t in (keys, values):
                if not torch.equal(t[a, :, a_start : a_start + n], t[b, :, b_start : b_start + n]):
                    return False
        return True

    def drop_rows(self, leaving: Sequence[int]) -> list[int]:
        """Drop the rows `leaving` (indices), each place taken by the batch's last row; the rows' former
        indices in their new order."""
        order = list(range(self._rows()))
        for index in sorted(leaving, reverse=True):
            last = len(order) - 1
            for room in self._rooms.values():
                if index != last:
                    room.keys[index, :, room.start : room.stop] = room.keys[last, :, room.start : room.stop]
                    room.values[index, :, room.start : room.stop] = room.values[last, :, room.start : room.stop]
                room.rows -= 1
            order[index] = order[last]
            order.pop()
        self._set_views()
        return order

    def drop_columns(self, columns: int) -> None:
        """Drop the first `columns` columns (padding every row shares)."""
        for room in self._rooms.values():
            room.start += columns
        self._set_views()

    def _rows(self) -> int:
        return next(iter(self._rooms.values())).rows if self._rooms else 0

    def _set_views(self) -> None:
        """Each layer holds its room's views (the adapter's `restore_kv`: no copy)."""
        for i, room in self._rooms.items():
            keys, values = room.views()
            self.profile.adapters[i].restore_kv(self.layers[i], keys, values, keys.shape[-2])


def _kv(layer: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A layer's keys and values, None where it has none."""
    return getattr(layer, "keys", None), getattr(layer, "values", None)
