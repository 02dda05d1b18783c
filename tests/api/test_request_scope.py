"""`PrefixCache.request`: a block's own calls, per thread and per task, counted as `stats()` counts them.

Each scope must read exactly the change in `stats()` its calls make when they run alone, also while
another thread or task generates through the same store at the same time (a barrier holds both
inside `generate` together); blocks nest; the salt keeps entries apart; only the store's own calls count.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from typing import Any

import torch
from conftest import build, distinct_prompt, generate
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_prefix_cache import PrefixCache, RequestScope

# Two requests of two calls each: a prompt whose first part is stored beforehand, then a longer one.
PROMPTS = {"a": distinct_prompt(1, 40), "b": distinct_prompt(2, 33)}
STORED = {"a": 20, "b": 12}  # tokens of each prompt stored before the requests


class _MeetInsideGenerate(StoppingCriteria):
    """Waits once, at the first decoding step, until every request is inside `generate`; never stops."""

    def __init__(self, barrier: threading.Barrier | None) -> None:
        self.barrier = barrier

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        if self.barrier is not None:
            self.barrier.wait()
            self.barrier = None
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def _prepared_store(model: Any) -> PrefixCache:
    store = PrefixCache(model)
    for name, ids in PROMPTS.items():
        generate(model, ids[:, : STORED[name]], 1, cache=store)
    return store


def _calls(model: Any, store: PrefixCache | None, name: str, barrier: threading.Barrier | None = None) -> list[Any]:
    """The two calls of request `name` (None: cold); the first meets the other request's inside `generate`."""
    ids = PROMPTS[name]
    longer = torch.cat([ids, distinct_prompt(3, 7)], dim=1)
    cache = {} if store is None else {"cache": store}
    meet = StoppingCriteriaList([_MeetInsideGenerate(barrier)])
    return [generate(model, ids, 4, stopping_criteria=meet, **cache), generate(model, longer, 4, **cache)]


def _numbers(scope: RequestScope) -> tuple[int, int, int, dict[str, int]]:
    return scope.cached_tokens, scope.prompt_tokens, scope.calls, scope.fallbacks


def _alone(model: Any) -> dict[str, tuple[int, int, int, dict[str, int]]]:
    """Each request on a store of its own, run alone: its scope's numbers, checked against the change in `stats()`."""
    found = {}
    for name in PROMPTS:
        store = _prepared_store(model)
        before = store.stats()
        with store.request() as scope:
            _calls(model, store, name)
        after = store.stats()
        delta = (
            after.hit_tokens - before.hit_tokens,
            after.prompt_tokens - before.prompt_tokens,
            after.requests - before.requests,
            dict(Counter(after.fallbacks) - Counter(before.fallbacks)),
        )
        assert _numbers(scope) == delta
        assert scope.cached_tokens >= STORED[name] + PROMPTS[name].shape[1]  # a partial hit, then a whole one
        found[name] = delta
        store.detach()
    return found


def test_two_threads_at_once_each_read_their_own_calls_as_when_alone() -> None:
    """Two threads generate through one store at the same time: each scope holds its calls' numbers, exactly."""
    model = build("llama")
    alone = _alone(model)
    cold = {name: _calls(model, None, name) for name in PROMPTS}
    store = _prepared_store(model)
    before = store.stats()
    barrier = threading.Barrier(len(PROMPTS), timeout=60)
    scopes: dict[str, RequestScope] = {}
    outputs: dict[str, list[Any]] = {}

    def request(name: str) -> None:
        with store.request() as scope:
            outputs[name] = _calls(model, store, name, barrier)
        scopes[name] = scope

    threads = [threading.Thread(target=request, args=(name,)) for name in PROMPTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {name: _numbers(scope) for name, scope in scopes.items()} == alone
    after = store.stats()
    assert after.hit_tokens - before.hit_tokens == sum(scope.cached_tokens for scope in scopes.values())
    for name in PROMPTS:
        for warm, cold_out in zip(outputs[name], cold[name], strict=True):
            assert torch.equal(warm.sequences, cold_out.sequences)
    store.detach()


def test_two_asyncio_tasks_at_once_each_read_their_own_calls_as_when_alone() -> None:
    """Two tasks, each generating on a worker thread (`asyncio.to_thread` copies the task's context), at once."""
    model = build("llama")
    alone = _alone(model)
    store = _prepared_store(model)
    barrier = threading.Barrier(len(PROMPTS), timeout=60)

    async def request(name: str) -> RequestScope:
        with store.request() as scope:
            await asyncio.to_thread(_calls, model, store, name, barrier)
        return scope

    async def both() -> list[RequestScope]:
        return list(await asyncio.gather(*(request(name) for name in PROMPTS)))

    scopes = asyncio.run(both())
    assert [_numbers(scope) for scope in scopes] == [alone[name] for name in PROMPTS]
    store.detach()


def test_nested_blocks_count_what_runs_inside_them_and_the_inner_salt_applies() -> None:
    """An outer block counts its own calls and the inner block's; the inner one only its own; salts nest."""
    model = build("llama")
    store = PrefixCache(model)
    ids = distinct_prompt(4, 30)
    with store.request(salt="t") as outer:
        generate(model, ids, 2, cache=store)  # stored under salt "t"
        with store.request() as inner:  # no salt of its own: "t" still applies
            generate(model, ids, 2, cache=store)
        with store.request(salt="u") as other:  # a salt of its own: nothing of "t" is reused
            generate(model, ids, 2, cache=store)
    generate(model, ids, 2, cache=store)  # no block, no salt: its own namespace
    assert (inner.cached_tokens, inner.calls) == (ids.shape[1] - 1, 1)
    assert (other.cached_tokens, other.calls) == (0, 1)
    assert (outer.cached_tokens, outer.calls, outer.prompt_tokens) == (ids.shape[1] - 1, 3, 3 * ids.shape[1])
    assert store.stats().hit_tokens == ids.shape[1] - 1 and store.stats().requests == 4
    store.detach()


def test_a_worker_thread_counts_only_once_it_enters_the_scope_and_entries_add_up() -> None:
    """A thread started inside a block does not see it; entering the scope there adds its calls to the block's."""
    model = build("llama")
    store = PrefixCache(model)
    ids = distinct_prompt(5, 24)
    generate(model, ids, 1, cache=store)
    with store.request() as scope:
        plain = threading.Thread(target=generate, args=(model, ids, 2), kwargs={"cache": store})
        plain.start()
        plain.join()
        assert scope.calls == 0

        def entered() -> None:
            with scope:
                generate(model, ids, 2, cache=store)

        worker = threading.Thread(target=entered)
        worker.start()
        worker.join()
        generate(model, ids, 2, cache=store)
    assert (scope.calls, scope.cached_tokens) == (2, 2 * (ids.shape[1] - 1))
    store.detach()


def test_only_the_stores_own_calls_count_and_batches_and_cold_runs_count_as_in_stats() -> None:
    """Another store's calls inside the block are not this scope's; a batch's rows and a cold run count as in stats."""
    model, other_model = build("llama"), build("llama")
    store = PrefixCache(model, attach="all")
    other = PrefixCache(other_model)
    ids = distinct_prompt(6, 28)
    generate(model, ids, 1)
    before = store.stats()
    with store.request() as scope:
        generate(other_model, ids, 2, cache=other)
        generate(model, ids.repeat(2, 1), 2)  # two rows, each restoring the stored prompt
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, use_cache=False, do_sample=False)
    after = store.stats()
    assert scope.calls == after.requests - before.requests == 2
    assert scope.cached_tokens == after.hit_tokens - before.hit_tokens == 2 * (ids.shape[1] - 1)
    assert scope.prompt_tokens == after.prompt_tokens - before.prompt_tokens == 3 * ids.shape[1]
    assert (
        scope.fallbacks == dict(Counter(after.fallbacks) - Counter(before.fallbacks))
        and sum(scope.fallbacks.values()) == 1
    )
    assert scope.cached_tokens_by_modality == {"text": scope.cached_tokens}
    assert other.stats().requests == 1
    store.detach()
    other.detach()
