"""Per-row sampling: a seeded row's tokens are its own, whoever decodes beside it; settings apply per row."""

from __future__ import annotations

import pytest
import torch
from conftest import CACHE_NAME, build, random_prompt

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.batching.batch import RunningBatch
from hf_prefix_cache.batching.rows import Request, Row
from hf_prefix_cache.batching.sampling import Chooser, Sampling

SEEDED = Sampling(temperature=0.9, top_k=40, top_p=0.95, seed=5)


@pytest.mark.parametrize("name", ["llama", "lfm2"])
def test_a_seeded_rows_tokens_do_not_change_when_neighbours_join_or_leave(name: str) -> None:
    """The same seeded request alone, then with a row joining after it and one leaving before it: equal tokens."""
    model = build(name)
    store = PrefixCache(model)
    prompt = random_prompt(25, seed=1)[0].tolist()
    alone = Row(Request(prompt, max_new_tokens=10, sampling=SEEDED))
    batch = RunningBatch(store)
    assert batch.admit(alone)
    while batch.rows:
        batch.step()
    crowded = Row(Request(prompt, max_new_tokens=10, sampling=SEEDED))
    short = Row(Request(random_prompt(33, seed=2)[0].tolist(), max_new_tokens=3, sampling=Sampling(0.7, seed=1)))
    late = Row(Request(random_prompt(12, seed=3)[0].tolist(), max_new_tokens=20))
    assert batch.admit(short) and batch.admit(crowded)
    for _ in range(4):
        batch.step()
    assert batch.admit(late)
    while crowded in batch.rows:
        batch.step()
    assert crowded.tokens == alone.tokens
    assert len(set(alone.tokens)) > 1  # it sampled, not a constant
    store.detach()


def test_a_greedy_logit_bias_equals_generates_sequence_bias() -> None:
    """A greedy row with a logit bias chooses as `generate` with the same bias as `sequence_bias`."""
    model = build("llama")
    store = PrefixCache(model)
    prompt = random_prompt(20, seed=4)[0].tolist()
    bias = {17: 4.0, 23: 3.0}
    row = Row(Request(prompt, max_new_tokens=8, sampling=Sampling(logit_bias=bias)))
    batch = RunningBatch(store)
    assert batch.admit(row)
    while batch.rows:
        batch.step()
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=8,
        do_sample=False,
        sequence_bias={(t,): b for t, b in bias.items()},
        **{CACHE_NAME: store},
    )
    assert row.tokens == out[0, len(prompt) :].tolist()
    assert 17 in row.tokens or 23 in row.tokens
    store.detach()


def test_min_new_tokens_holds_back_the_end_tokens() -> None:
    """Before `min_new_tokens`, an end token is never chosen, even when it has the highest logit."""
    logits = torch.tensor([0.0, 5.0, 1.0, 2.0])
    chooser = Chooser(Sampling(min_new_tokens=2), end_ids=frozenset({1}))
    assert [chooser.choose(logits, [3] * n) for n in range(3)] == [3, 3, 1]


def test_top_k_and_top_p_keep_only_the_likeliest_tokens() -> None:
    """Many draws from a row's generator land only on the tokens top_k and top_p leave."""
    logits = torch.tensor([4.0, 3.9, 1.0, 0.5, -2.0])
    top_k = Chooser(Sampling(temperature=1.0, top_k=2, seed=0), frozenset())
    top_p = Chooser(Sampling(temperature=1.0, top_p=0.6, seed=0), frozenset())
    assert {top_k.choose(logits, []) for _ in range(200)} == {0, 1}
    assert {top_p.choose(logits, []) for _ in range(200)} == {0, 1}


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        Sampling(temperature=1, top_p=1.5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        Request([1, 2], max_new_tokens=0)
