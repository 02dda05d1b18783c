"""The scheduler: arrivals start between steps (never after the rows in flight end), and rows it cannot batch run alone.

A row the batch cannot take (a setting the engine does not implement, a model whose rows cannot be laid
side by side) runs alone through `generate` with the store, counted under its `batch_alone:<why>` reason,
and answers exactly as that `generate` call does.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError
from typing import Any

import pytest
import torch
from conftest import CACHE_NAME, build, random_prompt

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.batching.rows import EndReason, Request, Row
from hf_prefix_cache.batching.scheduler import Scheduler


def alone(model: Any, prompt: list[int], new: int, **kwargs: Any) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, **kwargs)
    return list(out[0, len(prompt) :].tolist())


def test_an_arrival_starts_while_the_first_row_decodes_and_every_answer_is_exact() -> None:
    """A request sent after the first row's third token gets its first token before the first row ends."""
    model = build("llama")
    store = PrefixCache(model)
    prompts = [random_prompt(n, seed=s)[0].tolist() for n, s in ((30, 1), (18, 2))]
    third = threading.Event()

    def on_token(row: Row, token: int) -> None:
        if len(row.tokens) == 3:
            third.set()

    with Scheduler(store, num_threads=1) as scheduler:
        first = scheduler.submit(Request(prompts[0], max_new_tokens=40), on_token=on_token)
        assert third.wait(timeout=120)
        second = scheduler.submit(Request(prompts[1], max_new_tokens=5))
        assert first.wait(timeout=120) and second.wait(timeout=120)
    assert second.first_token_at is not None and first.ended_at is not None
    assert second.first_token_at < first.ended_at and second.ended_at is not None and second.ended_at < first.ended_at
    assert first.tokens == alone(model, prompts[0], 40) and second.tokens == alone(model, prompts[1], 5)
    assert first.alone_reason is None and second.alone_reason is None
    store.detach()


def test_a_setting_the_engine_lacks_runs_the_row_alone_counted() -> None:
    """`no_repeat_ngram_size` is not implemented by the batch: the row runs alone, exact, counted under its reason."""
    model = build("llama")
    store = PrefixCache(model)
    prompt = random_prompt(26, seed=3)[0].tolist()
    scheduler = Scheduler(store)
    row = scheduler.submit(Request(prompt, max_new_tokens=6, generate_kwargs={"no_repeat_ngram_size": 1}))
    plain = scheduler.submit(Request(prompt, max_new_tokens=6))
    scheduler.run_until_idle()
    assert row.alone_reason == "batch_alone:setting_no_repeat_ngram_size" and plain.alone_reason is None
    assert row.tokens == alone(model, prompt, 6, no_repeat_ngram_size=1) != plain.tokens
    assert row.end_reason is EndReason.LENGTH
    assert store.stats().fallbacks["batch_alone:setting_no_repeat_ngram_size"] == 1
    store.detach()


def test_a_row_running_alone_ends_at_its_stop_sequence_not_a_token_later() -> None:
    """generate streams a token after its stopping criteria ran: the alone row's stop still ends at the sequence."""
    model = build("llama")
    store = PrefixCache(model)
    prompt = random_prompt(22, seed=5)[0].tolist()
    full = alone(model, prompt, 10, no_repeat_ngram_size=1)
    scheduler = Scheduler(store)
    request = Request(prompt, 10, stop_sequences=(tuple(full[3:5]),), generate_kwargs={"no_repeat_ngram_size": 1})
    row = scheduler.submit(request)
    scheduler.run_until_idle()
    assert row.alone_reason is not None and row.end_reason is EndReason.STOP
    assert row.tokens == full[:5]
    store.detach()


def test_a_model_whose_rows_cannot_be_joined_runs_every_row_alone_through_the_store() -> None:
    """Mamba-2 (no attention mask to hide padding): each row runs alone, reusing and storing as generate does."""
    model = build("mamba2")
    store = PrefixCache(model)
    prompt = random_prompt(24, seed=4)[0].tolist()
    scheduler = Scheduler(store)
    rows = [scheduler.submit(Request(prompt, max_new_tokens=5)) for _ in range(2)]
    scheduler.run_until_idle()
    expected = alone(model, prompt, 5)
    assert [row.tokens for row in rows] == [expected, expected]
    assert [row.alone_reason for row in rows] == ["batch_alone:model"] * 2
    assert store.stats().fallbacks["batch_alone:model"] == 2
    assert rows[1].cached_tokens > 0  # the second reused what the first stored
    store.detach()


def test_a_row_cancelled_while_it_waits_never_runs_and_stop_cancels_the_rest() -> None:
    """Cancelled before admission: it ends unrun; `stop` ends rows still in flight, cancelled."""
    model = build("llama")
    store = PrefixCache(model)
    scheduler = Scheduler(store)
    early = scheduler.submit(Request(random_prompt(10, seed=5)[0].tolist(), max_new_tokens=5))
    early.cancel()
    scheduler.run_until_idle()
    assert early.end_reason is EndReason.CANCELLED and early.tokens == []
    scheduler.start()
    long = scheduler.submit(Request(random_prompt(10, seed=6)[0].tolist(), max_new_tokens=10_000))
    while not long.tokens:
        long.wait(timeout=0.05)
    scheduler.stop()
    assert long.end_reason is EndReason.CANCELLED and 0 < len(long.tokens) < 10_000
    with store.request() as scope:
        ids = torch.tensor([[*long.request.ids, *long.tokens, 7]])
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, **{CACHE_NAME: store})
    assert scope.cached_tokens == len(long.request.ids) + len(long.tokens) - 1  # what it computed was stored
    store.detach()


def test_a_callback_that_raises_ends_no_row() -> None:
    """A caller's `on_token` that raises is logged; its row and the others still finish exactly."""
    model = build("llama")
    store = PrefixCache(model)
    prompts = [random_prompt(n, seed=s)[0].tolist() for n, s in ((16, 7), (21, 8))]

    def broken(row: Row, token: int) -> None:
        raise RuntimeError("a client's bug")

    scheduler = Scheduler(store)
    rows = [scheduler.submit(Request(prompts[0], max_new_tokens=4), on_token=broken, on_end=broken)]
    rows.append(scheduler.submit(Request(prompts[1], max_new_tokens=6)))
    scheduler.run_until_idle()
    assert [row.end_reason for row in rows] == [EndReason.LENGTH, EndReason.LENGTH]
    assert [row.tokens for row in rows] == [alone(model, prompts[0], 4), alone(model, prompts[1], 6)]
    store.detach()


def test_a_call_runs_in_the_loop_between_two_steps_and_its_exception_fails_only_its_future() -> None:
    """`call` runs in the loop's thread while a row decodes, never inside a step (the row's tokens do not move
    while it runs); one that raises fails its own future, and the row and the next call go on, the row exact.
    Once the loop has stopped, a call is cancelled and a row ends unrun."""
    model = build("llama")
    store = PrefixCache(model)
    prompt = random_prompt(20, seed=9)[0].tolist()
    second = threading.Event()

    def on_token(row: Row, token: int) -> None:
        if len(row.tokens) == 2:
            second.set()

    with Scheduler(store) as scheduler:
        row = scheduler.submit(Request(prompt, max_new_tokens=30), on_token=on_token)
        assert second.wait(timeout=120)

        def look() -> tuple[str, int, int]:
            before = len(row.tokens)
            time.sleep(0.2)  # a step running beside it would add a token meanwhile
            return threading.current_thread().name, before, len(row.tokens)

        def broken() -> None:
            raise ValueError("the call's own fault")

        failed = scheduler.call(broken, reason="batch_alone:media")
        looked = scheduler.call(look)
        with pytest.raises(ValueError, match="own fault"):
            failed.result(timeout=120)
        name, before, after = looked.result(timeout=120)
        assert name == "hf-prefix-cache-batching" and before == after and 2 <= before < 30
        assert row.wait(timeout=120)
        assert scheduler.load().calls == 2 and scheduler.load().steps >= 29
    assert row.end_reason is EndReason.LENGTH and row.tokens == alone(model, prompt, 30)
    assert store.stats().fallbacks["batch_alone:media"] == 1
    late = scheduler.call(lambda: 1)  # the loop has stopped: nothing runs it
    with pytest.raises(CancelledError):
        late.result(timeout=1)
    unrun = scheduler.submit(Request(prompt, max_new_tokens=3))  # nor a row: it ends at once, unrun
    assert unrun.wait(timeout=1) and unrun.end_reason is EndReason.CANCELLED and unrun.tokens == []
    store.detach()
