"""What a row of a vision-language model keeps beyond its ids: its media's key, and where its next token sits.

The row's prompt is prefilled through the store with its `Request.inputs` (the processor's pixel values,
grids, marks), so the hook keys, restores and stores its media as the sequential path does. The batch's
decode steps then feed text only, and two facts of the prompt are kept for them (`RowMedia`, made once
when the row joins):

* its prompt's key, as the hook keys it: the finished row is stored under its prompt's media symbols
  and namespace, as `generate` through the store stores it (a key of token ids alone would let a
  prompt with the same placeholders and another image match it);
* its position shift: `generate` feeds each new token at the prompt's last position plus one, per
  position axis. Positions count tokens in plain models (no shift). M-RoPE models (Qwen2-VL, ...)
  number an image's placeholders by its grid, so each of their three axes lies off the cache length
  by the row's own delta; a decode step passes them explicitly, ``[4, B, 1]`` (the text row,
  then the three M-RoPE axes), so the `rope_deltas` such a model keeps per call is never read.

``` text
prompt          t  t  i  i  i  i  i  i  t     (an image of 2x3 merged patches)
temporal axis   0  1  2  2  2  2  2  2  5
height axis     0  1  2  2  2  3  3  3  5
width axis      0  1  2  3  4  2  3  4  5     next token: 6 on every axis, at cache length 9: shift -3
```

Example:
    >>> from hf_prefix_cache.api.prefix_cache import store_of
    >>> row_media(store_of(store), store_of(store).profile, ids, {}) is None  # a text model: nothing beyond ids
    True
    >>> step_positions(torch.tensor([9, 4]), [None, None]).tolist()
    [[9], [4]]
    >>> shifts = [torch.tensor([0, -3, -3, -3]), torch.zeros(4, dtype=torch.long)]
    >>> step_positions(torch.tensor([9, 4]), shifts)[..., 0].tolist()  # [text, temporal, height, width] x rows
    [[9, 4], [6, 4], [6, 4], [6, 4]]
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.hooks.media import prompt_layout, prompt_namespace
from hf_prefix_cache.keys.prefix_key import PrefixKey
from hf_prefix_cache.token_ids import TokenIds

if TYPE_CHECKING:
    from hf_prefix_cache.model.profile import ModelProfile
    from hf_prefix_cache.store.contract import Store


@dataclass(frozen=True, slots=True)
class RowMedia:
    """One row's prompt media as the batch needs them after its prefill.

    Attributes:
        prompt: the prompt's key as the hook keys it (media symbols over the placeholders, the namespace of
            the row's salt and of its media where every position sees them).
        shift: per position axis, how far the row's next position lies from its cache length
            (``[axes]``; None where positions count tokens).
    """

    prompt: PrefixKey
    shift: torch.Tensor | None

    def key(self, fed: Sequence[int]) -> PrefixKey:
        """The key of the row's finished sequence `fed` (its prompt, then the tokens fed after it)."""
        symbols = self.prompt.symbols
        return self.prompt.with_symbols([*symbols, *fed[len(symbols) :]])


def row_media(store: Store, profile: ModelProfile, ids: torch.Tensor, inputs: Mapping[str, Any]) -> RowMedia | None:
    """The media facts of the one-row prompt `ids` (``[1, L]``) with `inputs`, for a model with media; called
    inside the row's request scope (its salt is in the namespace).

    None where the model has no media adapter, or the prompt's media do not lay out (its prefill then ran
    cold through the store, and the row runs alone).
    """
    media = profile.media
    if media is None:
        return None
    kwargs = dict(inputs)
    tokens = TokenIds.from_bytes(array("q", ids[0].tolist()).tobytes())
    layout, _ = prompt_layout(profile, [tokens], kwargs)
    if layout is None:
        return None
    shift = None
    if media.has_positions:
        positions = media.prefill_positions(ids, kwargs)  # [axes, 1, L]: what generate computes for the prompt
        if positions is None:
            return None
        shift = positions[..., -1].reshape(-1) + 1 - ids.shape[1]
    namespace, _ = prompt_namespace(profile, store.namespace(), tokens, layout, kwargs)
    try:
        symbols = layout.symbols(tokens)
    except InconsistentStateError:  # a guard on the media symbols failed (the hook ran the prefill cold)
        return None
    spans = layout.spans
    return RowMedia(PrefixKey(namespace, symbols, spans, spans if profile.item_layers else ()), shift)


def step_positions(lengths: torch.Tensor, shifts: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """`position_ids` of one decode step of rows whose caches hold `lengths` (``[B]``) positions.

    ``[B, 1]`` where positions count tokens; ``[axes, B, 1]`` where rows carry shifts (every row of an
    M-RoPE model does, a text-only prompt's being zeros).
    """
    if all(shift is None for shift in shifts):
        return lengths[:, None]
    if any(shift is None for shift in shifts):
        raise ValueError("rows of one model either all carry position shifts or none does")
    stacked = torch.stack([shift.to(lengths.device) for shift in shifts if shift is not None])  # [B, axes]
    return (lengths[:, None] + stacked).T[:, :, None]
