"""A follow-up on a sample that ended at EOS while other rows went on reuses the whole sample, EOS included.

`generate` feeds such a row padding until every row has ended: attention keys are cut at the EOS,
and rows with recurrent states keep the states they had when they fed it (`hooks/recurrent_rows.py`: `EndStates`).
Each case runs the follow-up cold and through the store: tokens equal, logits within LOGIT_TOL, and
the hit tokens counted exactly (every token of the prompt and the sample through its EOS).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import CACHE_NAME, Hits, assert_same_as_cold, cached_model, random_prompt

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.tiny_build import PAD_ID
from tests.hooks.test_batches import left_padded

# An attention-only model beside hybrids of each kind of state and pure SSMs.
MODELS = ("llama", "bamba", "qwen3_next", "jamba", "falcon_h1", "lfm2", "zamba", "inkling_text", "mamba2", "mamba")
NEW = 10


def _ending(model: Any, ids: torch.Tensor, row: int, **kwargs: Any) -> int:
    """A token `row` generates third (and no row before it), to end that row early when named the EOS."""
    torch.manual_seed(0)
    free = model.generate(ids, max_new_tokens=NEW, pad_token_id=PAD_ID, eos_token_id=None, **kwargs)
    generated = free[:, ids.shape[1] :]
    token = int(generated[row, 2])
    if token in generated[:, :2].tolist() or token == PAD_ID:
        pytest.fail(f"token {token} is not new at step 3: pick another prompt")
    return token


def _follow_up(model: Any, store: PrefixCache, row: torch.Tensor, eos: int, start: int, width: int) -> None:
    """The sample of `row` (a prompt `width` columns wide, `start` of them padding) through its EOS, then new text:
    cold against cached, every token up to and with the EOS reused."""
    end = width + int((row[width:] == eos).nonzero()[0]) + 1
    if end >= row.shape[0] or int(row[end]) != PAD_ID:
        pytest.fail("the row did not end before the others: nothing to test")
    follow = torch.cat([row[None, start:end], random_prompt(6, seed=99)], 1)
    hits = Hits(store)
    assert_same_as_cold(model, follow, store, 4, eos_token_id=None, pad_token_id=PAD_ID)
    assert hits.last() == end - start


@pytest.mark.parametrize("name", MODELS)
def test_a_batch_row_that_ended_at_eos_is_reused_through_its_eos(name: str) -> None:
    """Two prompts, the shorter one (behind left padding) ending at EOS before the other."""
    model = cached_model(name)
    prompts = [random_prompt(30, seed=7), random_prompt(25, seed=8)]
    ids, mask = left_padded(prompts)
    eos = _ending(model, ids, 1, attention_mask=mask, do_sample=False)
    store = PrefixCache(model)
    try:
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=PAD_ID, **{CACHE_NAME: store}
        )
        _follow_up(model, store, out[1], eos, 30 - 25, 30)
        assert store.stats().fallbacks == {}
        store.check_integrity()
    finally:
        store.detach()


@pytest.mark.parametrize("name", ["bamba", "qwen3_next", "mamba2"])
def test_a_sample_that_ended_at_eos_is_reused_through_its_eos(name: str) -> None:
    """Three samples of one prompt, the second ending at EOS before the others (each stored as its own entry)."""
    model = cached_model(name)
    ids = random_prompt(30, seed=7)
    sampling = {"do_sample": True, "num_return_sequences": 3, "attention_mask": torch.ones_like(ids)}
    eos = _ending(model, ids, 1, **sampling)
    store = PrefixCache(model)
    try:
        torch.manual_seed(0)
        out = model.generate(
            ids, max_new_tokens=NEW, eos_token_id=eos, pad_token_id=PAD_ID, **sampling, **{CACHE_NAME: store}
        )
        _follow_up(model, store, out[1], eos, 0, 30)
        assert store.stats().fallbacks == {}
        store.check_integrity()
    finally:
        store.detach()
