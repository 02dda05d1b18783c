"""Cached generation equals cold generation, and hits what it should, for every cache layer type.

Each scenario runs every request twice, cold and through the store, and compares tokens and
logits; it also asserts how many prompt tokens came from the store. Models with recurrent
layers reuse only at snapshots (every `INTERVAL` tokens, prompt ends, answer ends,
divergences), Mamba-1, FalconMamba and Jamba included (their scan continues a cached state exactly).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import assert_same_as_cold, cached_model, random_prompt

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.tiny_models import FULL_ATTENTION, HYBRID, RECURRENT, SLIDING

INTERVAL = 16
ATTENTION = FULL_ATTENTION + SLIDING
STATEFUL = HYBRID + RECURRENT
ALL = ATTENTION + STATEFUL


@pytest.fixture(params=ALL)
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, Any, PrefixCache]]:
    model = cached_model(request.param)
    store = PrefixCache(model, snapshot_interval=INTERVAL)
    yield request.param, model, store
    store.check_integrity()
    store.detach()


class _Hits:
    """Reads how many prompt tokens the last request took from the store."""

    def __init__(self, store: PrefixCache) -> None:
        self.store = store
        self.seen = store.stats().hit_tokens

    def last(self) -> int:
        now = self.store.stats().hit_tokens
        hit, self.seen = now - self.seen, now
        return hit


def _distinct_start(a: torch.Tensor, seed: int, n: int) -> torch.Tensor:
    """A random prompt of `n` tokens whose first token differs from `a`'s."""
    b = random_prompt(n, seed=seed)
    if b[0, 0] == a[0, 0]:
        b[0, 0] = 4 + (int(a[0, 0]) - 3) % 90
    return b


def test_exact_repeat_reuses_all_but_the_last_token(served: tuple[str, Any, PrefixCache]) -> None:
    """Repeating a prompt reuses every token except the one whose logits are needed."""
    _, model, store = served
    hits = _Hits(store)
    prompt = random_prompt(40, seed=1)
    assert_same_as_cold(model, prompt, store)
    assert hits.last() == 0
    assert_same_as_cold(model, prompt, store)
    assert hits.last() == 39


def test_multi_turn_chat_reuses_prompt_and_answer(served: tuple[str, Any, PrefixCache]) -> None:
    """Turn N+1 extends turn N's prompt and answer and reuses all of it that was fed to the model."""
    _, model, store = served
    hits = _Hits(store)
    turn = random_prompt(40, seed=2)
    for i in range(3):
        out = assert_same_as_cold(model, turn, store, new=6)
        assert hits.last() == (0 if i == 0 else turn.shape[1] - 10 - 1)
        turn = torch.cat([out.sequences, random_prompt(10, seed=10 + i)], dim=1)


def test_shared_system_prompt_with_different_questions(served: tuple[str, Any, PrefixCache]) -> None:
    """Questions after one system prompt reuse it: at once for attention, from the divergence on for states."""
    name, model, store = served
    hits = _Hits(store)
    system = random_prompt(30, seed=3)
    questions = [random_prompt(10, seed=20)]
    for seed in (21, 22):
        q = random_prompt(10, seed=seed)
        q[0, 0] = 90 + seed  # a first token no other question has: each diverges right after the system prompt
        questions.append(q)
    seen = []
    for q in questions:
        assert_same_as_cold(model, torch.cat([system, q], dim=1), store)
        seen.append(hits.last())
    if name in ATTENTION:
        assert seen == [0, 30, 30]
    else:
        assert seen == [0, INTERVAL, 30]


def test_two_conversations_branching_from_a_common_prefix(served: tuple[str, Any, PrefixCache]) -> None:
    """Two conversations sharing a start each continue from their own full history."""
    _, model, store = served
    hits = _Hits(store)
    common = random_prompt(20, seed=4)
    a = torch.cat([common, random_prompt(10, seed=30)], dim=1)
    b = torch.cat([common, _distinct_start(a[:, 20:], 31, 10)], dim=1)
    out_a = assert_same_as_cold(model, a, store)
    out_b = assert_same_as_cold(model, b, store)
    hits.last()
    for out in (out_a, out_b):
        follow_up = torch.cat([out.sequences, random_prompt(5, seed=32)], dim=1)
        assert_same_as_cold(model, follow_up, store)
        assert hits.last() == out.sequences.shape[1] - 1


def test_prompt_diverging_in_the_middle_reuses_up_to_the_divergence(served: tuple[str, Any, PrefixCache]) -> None:
    """A prompt leaving a cached one at token 25 reuses up to 25 (or the last snapshot before it)."""
    name, model, store = served
    hits = _Hits(store)
    cached = random_prompt(40, seed=5)
    assert_same_as_cold(model, cached, store)
    assert hits.last() == 0
    diverging = torch.cat([cached[:, :25], _distinct_start(cached[:, 25:], 40, 15)], dim=1)
    assert_same_as_cold(model, diverging, store)
    expected = 25 if name in ATTENTION else INTERVAL
    assert hits.last() == expected
    assert_same_as_cold(model, diverging, store)
    assert hits.last() == 39
