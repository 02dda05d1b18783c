"""WorkingCache: the `transformers.Cache` that one `generate` call runs on.

Built fresh per request from the model's config, restored from the store to a prefix length,
then filled by the model as usual. Translates between transformers' layers and the store's
`Run`/`Snapshot` through the layer adapters; this is the only module that touches
transformers' cache attributes directly (through `layers/`). It asks each adapter for what it
can do (the capabilities its class declares, `layers/base.py`) and the profile for what the
layers can do together; it names no concrete adapter.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any

import torch
from transformers import Cache, DynamicCache

from hf_prefix_cache._compat import LINEAR_LAYERS_COUNT, set_linear_length
from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.model.landing import Landing, combine
from hf_prefix_cache.model.landing_kv import LANDS_ALL, KVPieces, LandingKV
from hf_prefix_cache.model.layers import LayerAdapter, LayerState
from hf_prefix_cache.model.layers.recurrent import clone_states
from hf_prefix_cache.model.own_caches import bridged
from hf_prefix_cache.model.profile import ModelProfile
from hf_prefix_cache.model.runs import Run, all_finite, pack, stack_one
from hf_prefix_cache.model.states import Captured, ItemState, Snapshot, merge_windows, state_tensors


class WorkingCache(DynamicCache):
    """A `DynamicCache` whose prefix came from a `PrefixCache`.

    Sliding-window layers record their whole past so that the store can later restore them to
    any length. `skip_len` tells our `prepare_inputs_for_generation` patch how many leading ids
    of the first `generate` step are already in the cache (where `generate` does not slice the
    prompt: `_compat.generate_slices_prompt`).
    """

    def __new__(cls, profile: ModelProfile) -> WorkingCache:
        # A model with its own cache (MiniMax's class, RWKV's state list) gets one bridged to it (`own_caches.py`).
        made = cls if profile.own_cache is None else bridged(cls, profile.own_cache)
        return super().__new__(made)

    def __init__(self, profile: ModelProfile) -> None:
        # The layers DynamicCache(config=...) would build, without re-reading the config per request.
        layers = []
        for cls, kwargs in profile.layer_specs:  # a loop, not a comprehension: no call of its own per request
            layers.append(cls(**kwargs))
        Cache.__init__(self, layers=layers)
        self.profile = profile
        self.skip_len: int | None = None
        #: The restored prefix's length, and the first position an indexer tied at (`model/indexer_ties.py`):
        #: the states from `tied_at` on may differ from a cold prefill's, so they are not stored.
        self.restored_len = 0
        self.prompt_len = 0  # the request's prompt length, where its hook says it (0: not known)
        self.tied_at: int | None = None
        self._landing: LandingKV | None = None
        for i in profile.prepared_layers:
            profile.adapters[i].prepare(layers[i])

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
        them and the copies into those still landing (maybe none); each layer is then set at its
        first use, and its pieces are joined by that use's own concatenation.
        """
        self.restored_len = length
        if landing is not None:
            assert keys is None and values is None and snapshot is None and not items
            self._restore_landing(length, landing[0], landing[1], batch_size)
            return
        profile, layers = self.profile, self.layers
        if batch_size != 1 and profile.has_state:
            raise InconsistentStateError("batched restores are for attention-only models")
        adapters = profile.adapters
        if profile.kv_layers:  # the layers with keys, then those with states (the profile lists each once)
            assert keys is not None and values is not None
            for i in profile.kv_layers:
                k, v = keys[i], values[i]
                if k is None or v is None:
                    raise InconsistentStateError(f"layer {i} has no stored keys")
                if batch_size > 1:
                    k, v = k.expand(batch_size, -1, -1, -1), v.expand(batch_size, -1, -1, -1)
                adapters[i].restore_kv(layers[i], k, v, length)
        recurrent: list[tuple[Any, LayerAdapter, LayerState]] = []  # states by reference: cloned together below
        for i in profile.state_layers:
            adapter = adapters[i]
            if snapshot is None:
                raise InconsistentStateError(f"a state restore of {length} tokens without a snapshot")
            if not snapshot.length - snapshot.reach <= length <= snapshot.length:
                raise InconsistentStateError(
                    f"a state restore of {length} tokens from a snapshot at {snapshot.length} (reach {snapshot.reach})"
                )
            state = snapshot.states[i]
            if length != snapshot.length:
                if not adapter.restores_below_length:
                    raise InconsistentStateError(f"layer {i}: only window states restore below their length")
                state = adapter.at(state, length)
            if adapter.has_state_refs:
                recurrent.append((layers[i], adapter, state))
            else:
                adapter.restore_state(layers[i], state)
        if recurrent:
            clones = clone_states([state for _, _, state in recurrent])
            for (layer, adapter, _), clone in zip(recurrent, clones, strict=True):
                adapter.load_state(layer, clone)
            self.count_linear(length)
        if items:
            self._restore_items(items)

    def get_seq_length(self, layer_idx: int = 0) -> Any:
        """Positions held, as `Cache.get_seq_length`; layer 0's question goes to `ModelProfile.length_layer`.

        `generate` slices the prompt by this. From 5.25 a linear layer 0 answers its own token counter, which
        models with module-kept or bridged states never advance: the first layer with keys answers instead, as
        transformers itself did before 5.25.
        """
        if layer_idx == 0 and LINEAR_LAYERS_COUNT:
            layer_idx = self.profile.length_layer
        return super().get_seq_length(layer_idx)

    def count_linear(self, length: int) -> None:
        """Linear layers count `length` tokens seen, as after a cold prefill (5.25, `_compat.set_linear_length`)."""
        if LINEAR_LAYERS_COUNT:
            for i in self.profile.state_layers:
                layer = self.layers[i]
                set_linear_length(layer, length, getattr(layer, "device", None))

    @property
    def defers_keys(self) -> bool:
        """Whether keys still landing can be restored layer by layer at first use (`restore(landing=...)`).

        Only for models whose every cached layer is plain full attention (`ModelProfile.defers_keys`): their
        layers are read only through `update` (in layer order) and the `Cache` methods, all of which land first.
        """
        return self.profile.defers_keys

    def _restore_landing(self, length: int, pieces: KVPieces, landings: Sequence[Landing], batch_size: int) -> None:
        """Load a prefix of `length` tokens from `pieces`, some maybe still being copied in (`model/landing.py`).

        Each layer holds a stand-in of the right shape (NaN: any read before it lands shows)
        until its first `update`, which waits for that layer's copy and sets its first piece; the
        other pieces go in front of the new keys, so the layer's own concatenation joins them
        all (one copy of the prefix, where a join before the prefill would make two). Any other
        `Cache` method, `capture_run` and iteration land and join every layer first. So the
        prefill of layer 0 runs while later layers are still copied.
        """
        assert self.defers_keys, "a landing restore is for models whose every cached layer is full attention"
        self._landing = LandingKV(self, length, pieces, combine(landings), batch_size)
        self.update = self._update_landing  # type: ignore[method-assign]
        for name in LANDS_ALL:
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
            key_states, value_states = landing.set_head(layer_idx, key_states, value_states)
            if not landing.pending:
                self._landed()
        return DynamicCache.update(self, key_states, value_states, layer_idx, *args, **kwargs)

    def _land_then(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self.land()
        return getattr(self, name)(*args, **kwargs)

    def _landed(self) -> None:
        """Every layer holds its keys: drop the landing and the instance methods that waited for it."""
        self._landing = None
        for name in ("update", *LANDS_ALL):
            self.__dict__.pop(name, None)

    def __iter__(self) -> Iterator[Any]:
        self.land()
        return iter(DynamicCache.__iter__(self))  # type: ignore[no-untyped-call]

    def _restore_items(self, items: Sequence[ItemState]) -> None:
        for i in self.profile.item_layers:
            adapter = self.profile.adapters[i]
            assert adapter.holds_items, f"layer {i} holds no media items"
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
            assert adapter.holds_items, f"layer {i} holds no media items"
            kv = adapter.capture_media(self.layers[i])
            if kv is None or kv[0].shape[-2] % len(ends) != 0:
                raise InconsistentStateError(
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
        return self.capture(length, row)[0]

    def capture(self, length: int, row: int | None = None, copy_from: int | None = None) -> tuple[Run, Run | None]:
        """`capture_run`, and with `copy_from` a packed copy (`Run.packed_copy`) of its positions `[copy_from, length)`.

        One pass over the layers makes both: each layer's keys are read once, while they are at hand. Where
        the copy is one stack, its device and size are every layer's (`stack` takes one device), so the run
        needs no read of either per layer.
        """
        if self._landing is not None:
            self.land()
        layers, adapters, kv_layers = self.layers, self.profile.adapters, self.profile.kv_layers
        num_layers = len(layers)
        keys: list[torch.Tensor | None] = [None] * num_layers
        values: list[torch.Tensor | None] = [None] * num_layers
        fresh_keys: list[torch.Tensor] = []
        fresh_values: list[torch.Tensor] = []
        start = length if copy_from is None else copy_from
        span = length - start
        dtype, same_dtype = None, True
        # Each layer with keys checked, cut only where it holds more (each view costs a dispatch), and its new
        # positions viewed for the copy.
        for i in kv_layers:
            kv = adapters[i].capture_kv(layers[i])
            if kv is None:
                raise InconsistentStateError(f"layer {i} holds no positions, expected {length}")
            k, v = kv
            held = k.shape[-2]
            if held != length:
                # Fewer only up to an indexer's tie (`exact_length`): what precedes it, by reference too.
                if self.tied_at is None or length >= held:
                    raise InconsistentStateError(f"layer {i} holds {held} positions, not {length}")
                k, v = k[..., :length, :], v[..., :length, :]
            if row is not None:
                k, v = k[row : row + 1], v[row : row + 1]
            keys[i], values[i] = k, v
            if copy_from is not None:
                fresh_keys.append(k.narrow(-2, start, span))
                fresh_values.append(v.narrow(-2, start, span))
                if dtype is None:
                    dtype = k.dtype
                same_dtype = same_dtype and k.dtype is dtype and v.dtype is dtype
        views = fresh_keys + fresh_values
        stack = stack_one(views, same_dtype) if copy_from is not None else None
        devices: list[torch.device | None]
        if stack is not None and span > 0:  # every layer's keys on the stack's device, holding its bytes per token
            device = stack.device
            devices = [device] * num_layers if len(kv_layers) == num_layers else [None] * num_layers
            if len(kv_layers) != num_layers:
                for i in kv_layers:
                    devices[i] = device
            per_token = stack.nbytes // span
        else:
            devices, nbytes = [None] * num_layers, 0
            for i in kv_layers:
                key, value = keys[i], values[i]
                assert key is not None and value is not None
                devices[i] = key.device
                nbytes += key.nbytes + value.nbytes
            per_token = nbytes // max(length, 1)
        run = Run.checked(keys, values, 0, length, devices, per_token)
        if copy_from is None:
            return run, None
        if stack is not None:  # its views per layer are made when read (`Run.packed`)
            return run, Run.packed(stack, kv_layers, num_layers, start, length, list(devices), per_token)
        copies, stacks = pack(views, same_dtype)  # several stacks (or none: no layer with keys)
        num_kv = len(kv_layers)
        tail_keys: list[torch.Tensor | None] = [None] * num_layers
        tail_values: list[torch.Tensor | None] = [None] * num_layers
        for j, i in enumerate(kv_layers):  # layers without keys keep their None
            tail_keys[i], tail_values[i] = copies[j], copies[num_kv + j]
        tail = Run.checked(tail_keys, tail_values, start, length, list(devices), per_token)
        tail.buffers = stacks
        return run, tail

    def snapshot(self, length: int) -> Snapshot:
        """Clones of every recurrent state, labelled with the number of tokens they summarise."""
        states = {}
        recurrent: dict[int, LayerState] = {}  # cloned together below
        for i, (layer, adapter) in enumerate(zip(self.layers, self.profile.adapters, strict=True)):
            if adapter.has_state_refs:
                recurrent[i] = adapter.state_refs(layer)
            elif adapter.has_state:
                state = adapter.snapshot_state(layer)
                assert state is not None
                states[i] = state
        states.update(zip(recurrent, clone_states(list(recurrent.values())), strict=True))
        return Snapshot(length, dict(sorted(states.items())))

    def captured(
        self,
        length: int,
        *,
        row: int | None = None,
        snapshots: Sequence[Snapshot] = (),
        items: Sequence[ItemState] = (),
        computed_from: int = 0,
    ) -> Captured | None:
        """What the store keeps of `[0, length)` (one `row` of a batch): its run, earlier `snapshots`, one at `length`.

        Positions from `computed_from` on, `snapshots` and `items` were computed by this request; None
        when any of them holds NaN or infinity (the store then keeps nothing). After a restored prefix the
        store likely keeps just the new positions: they are copied out once (one stack), and the check
        reads that copy.
        """
        start = min(computed_from, length)
        run, tail = self.capture(length, row, start if start > 0 else None) if self.profile.has_kv else (None, None)
        kept = list(snapshots)
        if self.profile.has_state:
            kept.append(self.snapshot(length))
            if not self.profile.has_recurrence:  # window mode: touching windows held once
                kept = merge_windows(kept, self.profile.adapters)
        if tail is not None:
            fresh: list[torch.Tensor | None] = list(tail.buffers)
        elif run is not None:  # nothing restored: every position is new, and the run holds exactly those
            fresh = [*run.keys, *run.values]
        else:
            fresh = []
        if kept or items:
            fresh += [*state_tensors(kept), *state_tensors(items)]
        if not all_finite(fresh):
            return None
        return Captured(run, tail, kept, run.nbytes_per_token if run is not None else 0)

    def kv_length(self) -> int | None:
        """Positions held by the attention layers, or None when the model has none."""
        if not self.profile.has_kv:
            return None
        return int(self.get_seq_length(self.profile.kv_layers[0]))

    def exact_length(self) -> int | None:
        """Positions whose states a cold prefill computes alike: `kv_length`, but not from an indexer's tie on."""
        if not self.profile.has_kv:
            return None
        # `kv_length`, without a call of its own. The first layer with keys, not layer 0: since 5.25 a linear layer 0
        # answers its own token counter, which module-kept and bridged states never advance.
        kv_len = int(self.get_seq_length(self.profile.kv_layers[0]))
        if self.tied_at is None:
            return kv_len
        # A recurrent state summarises every position: it cannot be taken back to the tie, so nothing is stored.
        return 0 if self.profile.has_state else min(kv_len, self.tied_at)


def _only(state: LayerState, name: str) -> torch.Tensor:
    tensor = state.tensors[name][0]
    assert tensor is not None, f"an item state without {name}"
    return tensor
