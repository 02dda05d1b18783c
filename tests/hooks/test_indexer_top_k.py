"""Sparse attention with an indexer reuses prompts several times its top-k exactly, and runs cold on a tie.

An indexer (DeepSeek-V3.2, GLM-5, Mistral Large 4, Qwen4-Exp) keeps the best-scored keys of each
query. A continuation on a restored prefix scores its own rows against the same keys as a full
prefill does, so it selects the same keys unless two scores tie at the top-k boundary: transformers
breaks a tie by the shape of the call (`test_a_continuation_with_ties_differs_from_the_prefill`).
The store watches every selection (`model/indexer_ties.py`): a tie in the prompt's suffix runs the
request cold (`indexer_tie`), a tie in a cold prefill stores the states only up to it.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from conftest import CACHE_NAME, LOGIT_TOL, Hits, assert_same_as_cold, generate, max_logit_diff

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.model.layers.indexed import IndexedAttentionAdapter
from hf_prefix_cache.model.profile import profile_model
from hf_prefix_cache.testing.media.generic import GenericFamily
from hf_prefix_cache.testing.tiny_attention import tiny_glm_moe_dsa, tiny_qwen4_exp
from hf_prefix_cache.testing.tiny_models import build

#: Found by test_media_generic's random conversations: Mistral Large 4's tiny indexer ties on the repeated 4s.
TIED = torch.tensor([[6, 4, 6, 6, 42, 84, 2, 54, 0, 4, 33, 29, 81, 51, 59, 4, 4, 4]])
FIRST_TURN = 10
TOP_K = 8  # keys per query (Qwen4-Exp: two blocks of 4 tokens, plus the query's incomplete block)
LONG = 48  # prompt tokens: 6 times the top-k
NAMES = ["deepseek_v32", "glm_moe_dsa", "mistral_large4", "qwen4_exp"]


def with_top_k(model: Any, top_k: int) -> Any:
    """A copy of `model` whose indexers keep `top_k` keys per query (its config says so too)."""
    other = copy.deepcopy(model)
    other.config.get_text_config(decoder=True).index_topk = top_k
    for module in other.modules():
        if hasattr(module, "index_topk"):
            module.index_topk = top_k
    return other


def indexed_model(name: str) -> Any:
    """The tiny `name`, its indexers keeping `TOP_K` keys."""
    if name == "qwen4_exp":
        return tiny_qwen4_exp()  # indexer_budget 8 already
    base = {"mistral_large4": lambda: GenericFamily(name).model, "glm_moe_dsa": tiny_glm_moe_dsa}.get(
        name, lambda: build(name)
    )()
    return with_top_k(base, TOP_K)


def tie_everything(name: str) -> Any:
    """Adversarial ties: the tiny `name` with its indexers' score weights zeroed: every key of every query scores 0."""
    other = indexed_model(name)
    for module in other.modules():
        if type(module).__name__.endswith("Indexer"):
            for name in ("weights_proj", "index_qk_proj"):
                if hasattr(module, name):
                    getattr(module, name).weight.data.zero_()
    return other


def random_ids(seed: int, n: int) -> torch.Tensor:
    return torch.randint(5, 90, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=NAMES)
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def model(name: str) -> Any:
    return indexed_model(name)


@pytest.fixture
def store(model: Any) -> Any:
    """A store on the module's model, detached after the test."""
    store = PrefixCache(model)
    yield store
    store.detach()


def test_the_profile_watches_every_indexer(model: Any) -> None:
    profile = profile_model(model)
    assert profile.unsupported is None
    assert profile.watch_indexers and profile.exact_prompt_len is None
    indexed = [a for a in profile.adapters if isinstance(a, IndexedAttentionAdapter)]
    # Only Qwen4-Exp keeps its indexers' positions (on the first indexed layer).
    assert [a.keeps_positions for a in indexed][:1] == [type(model).__name__.startswith("Qwen4")]
    assert profile_model(build("llama")).watch_indexers is False


def test_prompts_several_times_the_top_k_reuse_exactly(model: Any, store: Any) -> None:
    """Three turns of a chat 6 to 8 times the top-k: each reuses all the previous turn stored."""
    hits = Hits(store)
    # Qwen4-Exp's recurrent layer resumes from the prompt's snapshot, taken before its last token.
    short = 1 if profile_model(model).has_state else 0
    ids = random_ids(2, LONG)
    assert_same_as_cold(model, ids[:, : LONG // 2], store)
    assert hits.last() == 0
    second = assert_same_as_cold(model, ids, store)
    assert hits.last() == LONG // 2 - short
    third = torch.cat([second.sequences, random_ids(3, 8)], dim=1)
    assert_same_as_cold(model, third, store)
    assert hits.last() == second.sequences.shape[1] - 1  # the answer too, all but its last token
    assert not store.stats().fallbacks


def test_repeated_tokens_reuse_exactly_or_run_cold_saying_why(model: Any, store: Any) -> None:
    """Repeated tokens make near-equal scores: every turn equals its cold run, and reuses what was stored
    unless a tie at the top-k sent it cold with its reason."""
    hits = Hits(store)
    stored = LONG // 2 - (1 if profile_model(model).has_state else 0)  # as in the test above
    pattern = torch.tensor([[11, 12, 13, 12]]).repeat(1, LONG // 4)
    assert_same_as_cold(model, pattern[:, : LONG // 2], store)
    hits.last()
    ties = store.stats().fallbacks.get("indexer_tie", 0)  # the first prompt stored less than it could
    assert_same_as_cold(model, pattern, store)
    cold_now = store.stats().fallbacks.get("indexer_tie", 0) - ties
    hit = hits.last()
    assert (hit, cold_now) in {(0, 1), (stored, 0)} or (ties and hit < stored)
    assert set(store.stats().fallbacks) <= {"indexer_tie"}


def test_adversarial_ties_run_cold_and_say_why(name: str) -> None:
    """Every score 0: the first prompt stores only what precedes its first tie, the next runs cold."""
    tied = tie_everything(name)
    store = PrefixCache(tied)
    hits = Hits(store)
    ids = random_ids(3, LONG)
    assert_same_as_cold(tied, ids[:, : LONG // 2], store)
    assert_same_as_cold(tied, ids, store)
    assert hits.last() == 0
    assert store.stats().fallbacks == {"indexer_tie": 2}


def test_a_continuation_with_ties_differs_from_the_prefill() -> None:
    """Why ties matter: without any store, Mistral Large 4 continues this prompt otherwise than it prefills it."""
    model = with_top_k(GenericFamily("mistral_large4").model, 4)
    with torch.no_grad():
        full = model(TIED).logits
        head = model(TIED[:, :FIRST_TURN], use_cache=True)
        rest = model(
            TIED[:, FIRST_TURN:],
            past_key_values=head.past_key_values,
            position_ids=torch.arange(FIRST_TURN, TIED.shape[1])[None],
        )
    assert (rest.logits - full[:, FIRST_TURN:]).abs().max() > LOGIT_TOL


def test_the_store_runs_that_prompt_cold_and_says_why() -> None:
    model = with_top_k(GenericFamily("mistral_large4").model, 4)
    store = PrefixCache(model)
    hits = Hits(store)
    assert_same_as_cold(model, TIED[:, :FIRST_TURN], store)
    assert_same_as_cold(model, TIED, store)
    assert hits.last() == 0
    assert store.stats().fallbacks.get("indexer_tie", 0) >= 1
    assert set(store.stats().fallbacks) == {"indexer_tie"}


def test_within_the_top_k_reuse_is_exact_even_with_ties() -> None:
    model = with_top_k(GenericFamily("mistral_large4").model, 32)
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
