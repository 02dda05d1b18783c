"""What the hook reads back from the device: the prompt with one mask flag per row, and stored rows
that reuse the prompt already read only when `generate` returned it unchanged."""

from __future__ import annotations

import torch

from hf_prefix_cache import reasons
from hf_prefix_cache.integration.pipeline import _rows_on_host
from hf_prefix_cache.integration.refusals import read_prompt


def test_the_prompt_comes_back_without_its_mask_flags_and_any_zero_is_padding() -> None:
    """Rows come back as they were; a zero anywhere in any row's mask is padding."""
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    assert read_prompt(ids, torch.ones_like(ids), None) == ([[5, 6, 7], [8, 9, 10]], None)
    mask = torch.ones_like(ids)
    mask[1, 0] = 0
    assert read_prompt(ids, mask, None) == ([[5, 6, 7], [8, 9, 10]], reasons.PADDING)
    assert read_prompt(ids, torch.ones(1, 3, dtype=torch.long), None)[1] == reasons.ATTENTION_MASK_SHAPE


def test_stored_rows_reuse_the_prompt_only_when_generate_returned_it_unchanged() -> None:
    """The known prompt rows are reused when the returned sequences start with those ids, else all is read."""
    ids = torch.tensor([[5, 6, 7]])
    sequences = torch.tensor([[5, 6, 7, 40, 41]])
    sentinel = [[5, 6, 7]]
    assert _rows_on_host(sequences, 4, (ids, sentinel)) == [[5, 6, 7, 40]]
    changed = torch.tensor([[5, 99, 7, 40, 41]])  # a model whose generate rewrote its prompt
    assert _rows_on_host(changed, 4, (ids, sentinel)) == [[5, 99, 7, 40]]
    assert _rows_on_host(sequences, 2, (ids, sentinel)) == [[5, 6]]  # the cache covers less than the prompt
    assert _rows_on_host(sequences, 4, None) == [[5, 6, 7, 40]]
