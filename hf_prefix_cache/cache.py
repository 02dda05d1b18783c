"""WorkingCache: the `transformers.Cache` that one `generate` call runs on.

Built fresh per request from the model's config, restored from the store to a prefix length,
then filled by the model as usual. Translates between transformers' layers and the store's
`Run`/`Snapshot` through the layer adapters; this is the only module that touches
transformers' cache attributes directly (through `layers/`).
"""

from __future__ import annotations

import torch
from transformers import Cache, DynamicCache

from .profile import ModelProfile
from .segments import Run, Snapshot


class WorkingCache(DynamicCache):
    """A `DynamicCache` whose prefix came from a `PrefixCache`.

    Sliding-window layers record their whole past so that the store can later restore them to
    any length. `skip_len` tells our `prepare_inputs_for_generation` patch how many leading ids
    of the first `generate` step are already in the cache (models that take `cache_params`,
    whose ids transformers does not slice).
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
    ) -> None:
        """Load a prefix of `length` tokens: key views for attention layers, state clones for the rest.

        With `batch_size > 1` every row gets the same prefix (broadcast views; transformers
        concatenates onto them, which makes new tensors).
        """
        assert batch_size == 1 or not self.profile.has_state, "batched restores are for attention-only models"
        for i, (layer, adapter) in enumerate(zip(self.layers, self.profile.adapters, strict=True)):
            if adapter.has_kv:
                assert keys is not None and values is not None
                k, v = keys[i], values[i]
                assert k is not None and v is not None, f"layer {i} has no stored keys"
                if batch_size > 1:
                    k, v = k.expand(batch_size, -1, -1, -1), v.expand(batch_size, -1, -1, -1)
                adapter.restore_kv(layer, k, v, length)
            if adapter.has_state:
                assert snapshot is not None and snapshot.length == length, "state restore needs a snapshot at length"
                adapter.restore_state(layer, snapshot.states[i])

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
        for i, (layer, adapter) in enumerate(zip(self.layers, self.profile.adapters, strict=True)):
            if adapter.has_state:
                state = adapter.snapshot_state(layer)
                assert state is not None
                states[i] = state
        return Snapshot(length, states)

    def kv_length(self) -> int | None:
        """Positions held by the attention layers, or None when the model has none."""
        if not self.profile.has_kv:
            return None
        return int(self.get_seq_length())
