"""WorkingCache: the `transformers.Cache` that one `generate` call runs on.

Built fresh per request from the model's config, restored from the store to a prefix length,
then filled by the model as usual. Translates between transformers' layers and the store's
`Run`/`Snapshot` through the layer adapters; this is the only module that touches
transformers' cache attributes directly (through `layers/`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import Cache, DynamicCache

from hf_prefix_cache.model.layers import CrossAttentionAdapter, LayerState
from hf_prefix_cache.model.layers.recurrent import RecurrentAdapter, clone_states
from hf_prefix_cache.model.layers.sliding import WindowStateAdapter
from hf_prefix_cache.model.profile import ModelProfile
from hf_prefix_cache.model.states import ItemState, Run, Snapshot


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
    ) -> None:
        """Load a prefix of `length` tokens: key views for attention layers, state clones for the rest.

        With `batch_size > 1` every row gets the same prefix (broadcast views; transformers
        concatenates onto them, which makes new tensors). `items` are the states of the media
        items in the prefix, in prompt order: their vision keys/values fill the cross-attention layers.
        """
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
