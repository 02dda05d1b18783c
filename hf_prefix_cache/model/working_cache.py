"""WorkingCache: the `transformers.Cache` that one `generate` call runs on.

Built fresh per request from the model's config, restored from the store to a prefix length,
then filled by the model as usual. Translates between transformers' layers and the store's
`Run`/`Snapshot` through the layer adapters; this is the only module that touches
transformers' cache attributes directly (through `layers/`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import torch
from transformers import Cache, DynamicCache

from hf_prefix_cache.model.landing import Landing, combine
from hf_prefix_cache.model.layers import CrossAttentionAdapter, LayerState
from hf_prefix_cache.model.layers.full import FullAttentionAdapter
from hf_prefix_cache.model.layers.recurrent import RecurrentAdapter, clone_states
from hf_prefix_cache.model.layers.sliding import WindowStateAdapter
from hf_prefix_cache.model.profile import ModelProfile
from hf_prefix_cache.model.states import ItemState, Run, Snapshot

KVPieces = Sequence[tuple[Sequence[torch.Tensor | None], Sequence[torch.Tensor | None]]]

# Cache methods that read no key/value data (shapes and flags at most): they may run before a landing layer is set.
_READS_NO_DATA = frozenset(
    {
        "update",  # lands its own layer first (`_update_landing`)
        "get_seq_length",
        "get_mask_sizes",
        "get_max_length",
        "get_query_offset",
        "has_previous_state",
        "is_recording_past",
        "activate_past_recording",
    }
)
# Every other public Cache method lands every layer before it runs (in transformers 5.23-5.24: crop,
# reorder_cache, batch_repeat_interleave, batch_select_indices, offload, prefetch, reset, ...).
_LANDS_ALL = tuple(
    sorted(
        name
        for cls in (Cache, DynamicCache)
        for name, attr in vars(cls).items()
        if not name.startswith("_") and inspect.isfunction(attr) and name not in _READS_NO_DATA
    )
)


class WorkingCache(DynamicCache):
    """A `DynamicCache` whose prefix came from a `PrefixCache`.

    Sliding-window layers record their whole past so that the store can later restore them to
    any length. `skip_len` tells our `prepare_inputs_for_generation` patch how many leading ids
    of the first `generate` step are already in the cache (where `generate` does not slice the
    prompt: `_compat.generate_slices_prompt`).
    """

    def __init__(self, profile: ModelProfile) -> None:
        # The layers DynamicCache(config=...) would build, without re-reading the config per request.
        Cache.__init__(self, layers=[cls(**kwargs) for cls, kwargs in profile.layer_specs])
        self.profile = profile
        self.skip_len: int | None = None
        self._landing: _LandingKV | None = None
        for layer, adapter in zip(self.layers, profile.adapters, strict=True):
            adapter.prepare(layer)

    def restore(
        self,
        length: int,
        keys: list[torch.Tensor | None] | None,
        values: list[torch.Tensor | None] | None,
        snapshot: Snapshot | None,
        batch_size: int = 1,
        items: Sequence[ItemState] = (),
        landing: tuple[KVPieces, Sequence[Landing]] | None = None,
    ) -> None:
        """Load a prefix of `length` tokens: key views for attention layers, state clones for the rest.

        With `batch_size > 1` every row gets the same prefix (broadcast views; transformers
        concatenates onto them, which makes new tensors). `items` are the states of the media
        items in the prefix, in prompt order: their vision keys/values fill the cross-attention layers.
        `landing` (where `defers_keys`): instead of `keys` and `values`, the pieces that join into
        them and the copies into those still landing; each layer is then set at its first use.
        """
        if landing is not None:
            assert keys is None and values is None and snapshot is None and not items
            self._restore_landing(length, landing[0], landing[1], batch_size)
            return
        assert batch_size == 1 or not self.profile.has_state, "batched restores are for attention-only models"
        recurrent: list[tuple[Any, RecurrentAdapter, LayerState]] = []  # cloned together below
        for i, (layer, adapter) in enumerate(zip(self.layers, self.profile.adapters, strict=True)):
            if adapter.has_kv:
                assert keys is not None and values is not None
                k, v = keys[i], values[i]
                assert k is not None and v is not None, f"layer {i} has no stored keys"
                if batch_size > 1:
                    k, v = k.expand(batch_size, -1, -1, -1), v.expand(batch_size, -1, -1, -1)
                adapter.restore_kv(layer, k, v, length)
            if adapter.has_state:
                assert snapshot is not None, f"a state restore of {length} tokens without a snapshot"
                assert snapshot.length - snapshot.reach <= length <= snapshot.length, (
                    f"a state restore of {length} tokens from a snapshot at {snapshot.length} (reach {snapshot.reach})"
                )
                state = snapshot.states[i]
                if length != snapshot.length:
                    assert isinstance(adapter, WindowStateAdapter), "only window states restore below their length"
                    state = adapter.at(state, length)
                if isinstance(adapter, RecurrentAdapter):
                    recurrent.append((layer, adapter, state))
                else:
                    adapter.restore_state(layer, state)
        clones = clone_states([state for _, _, state in recurrent])
        for (layer, adapter, _), clone in zip(recurrent, clones, strict=True):
            adapter.load_state(layer, clone)
        if items:
            self._restore_items(items)

    @property
    def defers_keys(self) -> bool:
        """Whether keys still landing can be restored layer by layer at first use (`restore(landing=...)`).

        Only for models whose every cached layer is full attention: their layers are read only
        through `update` (in layer order) and the `Cache` methods, all of which land first.
        """
        adapters = [a for a in self.profile.adapters if a.has_kv or a.has_state]
        return (
            bool(adapters) and not self.profile.item_layers and all(type(a) is FullAttentionAdapter for a in adapters)
        )

    def _restore_landing(self, length: int, pieces: KVPieces, landings: Sequence[Landing], batch_size: int) -> None:
        """Load a prefix of `length` tokens whose keys are still being copied in (`model/landing.py`).

        Each layer holds a stand-in of the right shape (NaN: any read before it lands shows)
        until its first `update`, which waits for that layer's copy, joins its `pieces` and sets
        them; any other `Cache` method, `capture_run` and iteration land every layer first.
        So the prefill of layer 0 runs while later layers are still copied.
        """
        assert self.defers_keys, "a landing restore is for models whose every cached layer is full attention"
        landing = combine(landings)
        assert landing is not None, "restore_landing without anything landing"
        self._landing = _LandingKV(self, length, pieces, landing, batch_size)
        self.update = self._update_landing  # type: ignore[method-assign]
        for name in _LANDS_ALL:
            setattr(self, name, partial(self._land_then, name))

    def land(self) -> None:
        """Set every layer that is still waiting for its keys (`restore(landing=...)`); nothing to do otherwise."""
        if self._landing is not None:
            for i in sorted(self._landing.pending):
                self._landing.set_layer(i)
            self._landed()

    def _update_landing(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> Any:
        landing = self._landing
        if landing is not None and layer_idx in landing.pending:
            landing.set_layer(layer_idx)
            if not landing.pending:
                self._landed()
        return DynamicCache.update(self, key_states, value_states, layer_idx, *args, **kwargs)

    def _land_then(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self.land()
        return getattr(self, name)(*args, **kwargs)

    def _landed(self) -> None:
        """Every layer holds its keys: drop the landing and the instance methods that waited for it."""
        self._landing = None
        for name in ("update", *_LANDS_ALL):
            self.__dict__.pop(name, None)

    def __iter__(self) -> Iterator[Any]:
        self.land()
        return iter(DynamicCache.__iter__(self))  # type: ignore[no-untyped-call]

    def _restore_items(self, items: Sequence[ItemState]) -> None:
        for i in self.profile.item_layers:
            adapter = self.profile.adapters[i]
            assert isinstance(adapter, CrossAttentionAdapter)
            keys = [_only(item.states[i], "keys") for item in items]
            values = [_only(item.states[i], "values") for item in items]
            # [B, H, vision tokens of all items, D]; one item restores as the stored tensor itself.
            k = keys[0] if len(keys) == 1 else torch.cat(keys, dim=-2)
            v = values[0] if len(values) == 1 else torch.cat(values, dim=-2)
            adapter.restore_media(self.layers[i], k, v)

    def capture_items(self, ends: Sequence[int], skip: int) -> list[ItemState]:
        """States of the media items whose placeholders end at `ends` (prompt order), but the first `skip`.

        The cross-attention layers hold one equal block of vision tokens per item, in item order
        (images are encoded one by one). Blocks are copied out when the layer holds several, so a
        stored item keeps only its own bytes.
        """
        if not self.profile.item_layers or len(ends) <= skip:
            return []
        held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in self.profile.item_layers:
            adapter = self.profile.adapters[i]
            assert isinstance(adapter, CrossAttentionAdapter)
            kv = adapter.capture_media(self.layers[i])
            assert kv is not None and kv[0].shape[-2] % len(ends) == 0, (
                f"cross-attention layer {i} holds {None if kv is None else kv[0].shape[-2]} vision tokens "
                f"for {len(ends)} items"
            )
            held[i] = kv
        out = []
        for j in range(skip, len(ends)):
            states = {}
            for i, (k, v) in held.items():
                n = k.shape[-2] // len(ends)
                kj, vj = k[..., j * n : (j + 1) * n, :], v[..., j * n : (j + 1) * n, :]
                if len(ends) > 1:
                    kj, vj = kj.clone(), vj.clone()
                states[i] = LayerState(tensors={"keys": {0: kj}, "values": {0: vj}}, flags={})
            out.append(ItemState(ends[j], states))
        return out

    def capture_run(self, length: int, row: int | None = None) -> Run:
        """The keys/values of positions `[0, length)` (of one batch `row`), by reference."""
        self.land()
        keys: list[torch.Tensor | None] = []
        values: list[torch.Tensor | None] = []
        for i, (layer, adapter) in enumerate(zip(self.layers, self.profile.adapters, strict=True)):
            kv = adapter.capture_kv(layer) if adapter.has_kv else None
            if adapter.has_kv:
                assert kv is not None and kv[0].shape[-2] == length, (
                    f"layer {i} holds {None if kv is None else kv[0].shape[-2]} positions, expected {length}"
                )
            if kv is not None and row is not None:
                kv = kv[0][row : row + 1], kv[1][row : row + 1]
            keys.append(kv[0] if kv is not None else None)
            values.append(kv[1] if kv is not None else None)
        return Run(keys, values, 0, length)

    def snapshot(self, length: int) -> Snapshot:
        """Clones of every recurrent state, labelled with the number of tokens they summarise."""
        states = {}
        recurrent: dict[int, LayerState] = {}  # cloned together below
        for i, (layer, adapter) in enumerate(zip(self.layers, self.profile.adapters, strict=True)):
            if isinstance(adapter, RecurrentAdapter):
                recurrent[i] = adapter.state_refs(layer)
            elif adapter.has_state:
                state = adapter.snapshot_state(layer)
                assert state is not None
                states[i] = state
        states.update(zip(recurrent, clone_states(list(recurrent.values())), strict=True))
        return Snapshot(length, dict(sorted(states.items())))

    def merge_windows(self, snapshots: Sequence[Snapshot]) -> list[Snapshot]:
        """Window-only snapshots whose windows touch become one extended snapshot (fewer bytes than two).

        Only for models whose every state layer is a window (sliding layers in window mode): the
        merged snapshot sits at the later length and restores any length back to the earlier one.
        """
        if self.profile.has_recurrence or not self.profile.has_state:
            return list(snapshots)
        out: list[Snapshot] = []
        for snap in sorted(snapshots, key=lambda s: s.length):
            if out and snap.length > out[-1].length:
                merged = self._extend(out[-1], snap)
                if merged is not None:
                    out[-1] = merged
                    continue
            out.append(snap)
        return out

    def _extend(self, earlier: Snapshot, later: Snapshot) -> Snapshot | None:
        states = {}
        for i, state in later.states.items():
            extended = WindowStateAdapter.extend(earlier.states[i], state)
            if extended is None:
                return None
            states[i] = extended
        return Snapshot(later.length, states, reach=later.length - earlier.length + earlier.reach)

    def kv_length(self) -> int | None:
        """Positions held by the attention layers, or None when the model has none."""
        if not self.profile.has_kv:
            return None
        return int(self.get_seq_length())


def _only(state: LayerState, name: str) -> torch.Tensor:
    tensor = state.tensors[name][0]
    assert tensor is not None, f"an item state without {name}"
    return tensor


class _LandingKV:
    """The layers of a `WorkingCache` still waiting for their keys, and what sets each of them."""

    def __init__(self, cache: WorkingCache, length: int, pieces: KVPieces, landing: Landing, batch_size: int) -> None:
        self.cache = cache
        self.length = length
        self.pieces = pieces
        self.landing = landing
        self.batch_size = batch_size
        self.pending: set[int] = set()
        stand_ins: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        for i, (layer, adapter) in enumerate(zip(cache.layers, cache.profile.adapters, strict=True)):
            if not adapter.has_kv:
                continue
            k, v = pieces[0][0][i], pieces[0][1][i]
            assert k is not None and v is not None, f"layer {i} has no stored keys"
            where = (k.device, k.dtype)
            if where not in stand_ins:
                stand_ins[where] = torch.full((), float("nan"), dtype=k.dtype, device=k.device)
            shape_k = (batch_size, *k.shape[1:-2], length, k.shape[-1])
            shape_v = (batch_size, *v.shape[1:-2], length, v.shape[-1])
            adapter.restore_kv(layer, stand_ins[where].expand(shape_k), stand_ins[where].expand(shape_v), length)
            self.pending.add(i)

    def set_layer(self, i: int) -> None:
        """Wait for layer `i`'s copy, join its pieces and set them in the layer."""
        self.pending.discard(i)
        self.landing.ready(i)
        ks = [p[0][i] for p in self.pieces]
        vs = [p[1][i] for p in self.pieces]
        k = ks[0] if len(ks) == 1 else torch.cat(ks, dim=-2)  # type: ignore[arg-type]
        v = vs[0] if len(vs) == 1 else torch.cat(vs, dim=-2)  # type: ignore[arg-type]
        assert k is not None and v is not None
        if self.batch_size > 1:
            k, v = k.expand(self.batch_size, -1, -1, -1), v.expand(self.batch_size, -1, -1, -1)
        self.cache.profile.adapters[i].restore_kv(self.cache.layers[i], k, v, self.length)
