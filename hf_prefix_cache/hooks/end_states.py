"""EndStates: each row's recurrent states as they were right after it fed its end-of-sequence token.

In a batch (several prompts, or several samples of one), `generate` keeps feeding a row that
ended at EOS with padding until every row has ended. Attention keys are per position, so the
stored row can be cut anywhere; a recurrent state summarises everything fed, so the batch's final
state of such a row is at the wrong length for the sample (it has seen the padding too), and a
follow-up on the sample (prompt, sample, its EOS, new text) could only restore up to the prompt's
snapshot. `EndStates` rides along as a logits processor, which `generate` calls after each forward
with the ids fed so far (the cache then holds exactly those positions): when a row's last fed id
is its first generated EOS, it clones that row's states. The store step then stores the row up to
and with its EOS, with those states (`recurrent_rows.store_finished`).

Only where the forward feeds one position per step (no beams, which reorder rows; no assisted
decoding, whose forwards hold several candidates).

>>> from transformers import LogitsProcessor
>>> issubclass(EndStates, LogitsProcessor)
True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from hf_prefix_cache.model.layers import LayerState
from hf_prefix_cache.model.layers.recurrent import select_row
from hf_prefix_cache.model.working_cache import WorkingCache

#: `generate`'s third positional parameter (after `inputs` and `generation_config`).
_LOGITS_PROCESSOR_POSITION = 2


class EndStates(LogitsProcessor):
    """A logits processor that changes no score: it clones a row's recurrent states when the row has just fed its
    first generated EOS (at `prompt_len` or later), keyed by the row's index in the batch.

    `ends[row]` is `(length, states)`: the row's states after `length` columns (its left padding included), by layer
    index, one row each.
    """

    def __init__(self, cache: WorkingCache, eos: frozenset[int], prompt_len: int) -> None:
        self._cache = cache
        self._eos = eos
        self._prompt_len = prompt_len
        self.ends: dict[int, tuple[int, dict[int, LayerState]]] = {}

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        fed = int(input_ids.shape[1])
        if fed <= self._prompt_len:
            return scores  # the prompt's own forward: an EOS in the prompt does not end a row
        kv_len = self._cache.kv_length()
        if kv_len is not None and kv_len != fed:
            return scores  # not one position per forward: nothing captured (the row reuses less, never wrongly)
        last = input_ids[:, -1].tolist()
        for row, token in enumerate(last):
            if token in self._eos and row not in self.ends:
                self.ends[row] = (fed, self._row_states(row))
        return scores

    def _row_states(self, row: int) -> dict[int, LayerState]:
        cache = self._cache
        return {
            i: select_row(adapter.state_refs(layer), row)
            for i, (layer, adapter) in enumerate(zip(cache.layers, cache.profile.adapters, strict=True))
            if adapter.has_state_refs
        }


def ride_along(kwargs: dict[str, Any], args: Sequence[Any], processor: EndStates) -> bool:
    """Add `processor` to the `logits_processor` of `generate`'s `kwargs` (after the caller's own); False, nothing
    added, where the caller passed them positionally."""
    if len(args) > _LOGITS_PROCESSOR_POSITION:
        return False
    kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or ()), processor])
    return True
