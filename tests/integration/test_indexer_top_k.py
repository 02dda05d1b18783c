"""Sparse attention with an indexer reuses exactly up to its top-k, and runs cold past it, saying why.

An indexer (DeepSeek-V3.2, Mistral Large 4, GLM-5, ...) keeps the `index_topk` best-scored keys of
each query. While a prompt is no longer than that, every query keeps all its keys whatever the
scores, so a suffix's prefill on a restored prefix attends exactly as the whole prompt's prefill.
Past it, tied scores are broken by the shape of the call: transformers' own continuation of a prompt
then differs from its prefill (`test_media_generic.py`), so the store must not serve it.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from conftest import CACHE_NAME, LOGIT_TOL, Hits, assert_same_as_cold, generate, max_logit_diff

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.model.profile import profile_model
from hf_prefix_cache.testing.media.generic import GenericFamily
from hf_prefix_cache.testing.tiny_models import build

#: Found by test_media_generic's random conversations: Mistral Large 4's tiny indexer ties on the repeated 4s.
TIED = torch.tensor([[6, 4, 6, 6, 42, 84, 2, 54, 0, 4, 33, 29, 81, 51, 59, 4, 4, 4]])
FIRST_TURN = 10


def with_top_k(model: Any, top_k: int) -> Any:
    """A copy of `model` whose indexers keep `top_k` keys per query (its config says so too)."""
    other = copy.deepcopy(model)
    other.config.get_text_config(decoder=True).index_topk = top_k
    for module in other.modules():
        if hasattr(module, "index_topk"):
            module.index_topk = top_k
    return other


def indexed_model(name: str) -> Any:
    return GenericFamily(name).model if name == "mistral_large4" else build(name)


@pytest.fixture(scope="module", params=["deepseek_v32", "mistral_large4"])
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_the_profile_knows_the_longest_exact_prompt(name: str) -> None:
    assert profile_model(with_top_k(indexed_model(name), 4)).exact_prompt_len == 4
    assert profile_model(build("llama")).exact_prompt_len is None


def test_a_continuation_past_the_top_k_differs_from_the_prefill() -> None:
    """Why the limit: without any store, Mistral Large 4 continues this prompt otherwise than it prefills it."""
    model = with_top_k(indexed_model("mistral_large4"), 4)
    with torch.no_grad():
        full = model(TIED).logits
        head = model(TIED[:, :FIRST_TURN], use_cache=True)
        rest = model(
            TIED[:, FIRST_TURN:],
            past_key_values=head.past_key_values,
            position_ids=torch.arange(FIRST_TURN, TIED.shape[1])[None],
        )
    assert (rest.logits - full[:, FIRST_TURN:]).abs().max() > LOGIT_TOL


def test_past_the_top_k_the_store_runs_cold_and_says_why(name: str) -> None:
    model = with_top_k(indexed_model(name), 4)
    store = PrefixCache(model)
    hits = Hits(store)
    assert_same_as_cold(model, TIED[:, :FIRST_TURN], store)
    assert_same_as_cold(model, TIED, store)
    assert hits.last() == 0
    assert store.stats().fallbacks == {"indexer_top_k:4": 2}


def test_within_the_top_k_reuse_is_exact_even_with_ties(name: str) -> None:
    model = with_top_k(indexed_model(name), 32)
    store = PrefixCache(model)
    hits = Hits(store)
    first = generate(model, TIED[:, :FIRST_TURN], **{CACHE_NAME: store})
    assert hits.last() == 0
    cold = generate(model, TIED)
    warm = generate(model, TIED, **{CACHE_NAME: store})
    assert hits.last() == FIRST_TURN  # the first prompt (its answer differs from what follows here)
    assert torch.equal(cold.sequences, warm.sequences)
    assert max_logit_diff(cold, warm) < LOGIT_TOL
    assert first.sequences.shape[1] > FIRST_TURN
    assert not store.stats().fallbacks
