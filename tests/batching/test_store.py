"""Rows in the batch reuse and store like the sequential path: hit counts, the next turn's reuse, salts, cancellation.

Every number is compared with what `model.generate` through a second store reports for the same requests
run one after another (today's server).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import CACHE_NAME, build, random_prompt

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.batching.batch import RunningBatch
from hf_prefix_cache.batching.rows import EndReason, Request, Row

MODELS = ("llama", "mistral", "qwen3_next")


@pytest.fixture(scope="module", params=MODELS)
def model(request: pytest.FixtureRequest) -> Any:
    return build(request.param)


def sequential(model: Any, store: PrefixCache, prompt: list[int], new: int, salt: str | None = None) -> tuple[Any, int]:
    """The request through `generate` and the store, as the server runs it today: its new tokens and cached tokens."""
    ids = torch.tensor([prompt])
    with store.request(salt) as scope:
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, **{CACHE_NAME: store}
        )
    return out[0, len(prompt) :].tolist(), scope.cached_tokens


def batched(store: PrefixCache, requests: list[Request]) -> list[Row]:
    """The requests through the running batch, each joining one step after the one before."""
    batch = RunningBatch(store)
    rows = [Row(r) for r in requests]
    for row in rows:
        assert batch.admit(row)
        batch.step()
    while batch.rows:
        batch.step()
    return rows


def chats() -> tuple[list[int], list[list[int]]]:
    """A shared 30-token system prompt and three users' distinct turns after it."""
    system = random_prompt(30, seed=11)[0].tolist()
    turns = [random_prompt(n, seed=20 + i)[0].tolist() for i, n in enumerate((9, 14, 6))]
    return system, [system + turn for turn in turns]


def test_hit_counts_and_the_next_turns_reuse_equal_the_sequential_path(model: Any) -> None:
    """Turn 1 batched reuses the shared prefix as the sequential turn 1 does; turn 2 then reuses as much after each."""
    _, prompts = chats()
    in_batch, one_by_one = PrefixCache(model), PrefixCache(model)
    rows = batched(in_batch, [Request(p, max_new_tokens=5 + i) for i, p in enumerate(prompts)])
    expected = [sequential(model, one_by_one, p, 5 + i) for i, p in enumerate(prompts)]
    assert [row.tokens for row in rows] == [tokens for tokens, _ in expected]
    assert [row.cached_tokens for row in rows] == [cached for _, cached in expected]
    assert rows[2].cached_tokens >= 30  # the shared system prompt (a hybrid snapshots it when row 1 diverges)
    for i, (prompt, row) in enumerate(zip(prompts, rows, strict=True)):
        turn2 = prompt + row.tokens + random_prompt(5, seed=40 + i)[0].tolist()
        after_batch = sequential(model, in_batch, turn2, 3)
        after_sequential = sequential(model, one_by_one, turn2, 3)
        assert after_batch == after_sequential
        assert after_batch[1] == len(prompt) + len(row.tokens) - 1  # all the stored turn (its last token never fed)
    for store in (in_batch, one_by_one):
        store.check_integrity()
        store.detach()


def test_rows_reuse_only_under_their_salt(model: Any) -> None:
    """A row stores and reuses under its own salt only, as a `store.request(salt)` block does."""
    store = PrefixCache(model)
    prompt = random_prompt(24, seed=5)[0].tolist()
    batched(store, [Request(prompt, max_new_tokens=4, salt="tenant-a")])
    again, other = batched(
        store, [Request(prompt, max_new_tokens=4, salt="tenant-a"), Request(prompt, max_new_tokens=4, salt="tenant-b")]
    )
    assert again.cached_tokens == len(prompt) - 1 and other.cached_tokens == 0
    store.detach()


def test_a_cancelled_row_stores_its_prompt_and_tokens_so_far(model: Any) -> None:
    """Cancelled after three steps: it leaves at the next, and the next request reuses all it had fed."""
    store = PrefixCache(model)
    prompt = random_prompt(28, seed=6)[0].tolist()
    batch = RunningBatch(store)
    row, other = Row(Request(prompt, max_new_tokens=50)), Row(Request(random_prompt(12, seed=8)[0].tolist(), 6))
    assert batch.admit(row) and batch.admit(other)
    for _ in range(3):
        batch.step()
    row.cancel()
    batch.end_flagged()
    assert row.end_reason is EndReason.CANCELLED and len(row.tokens) == 4 and batch.rows == [other]
    while batch.rows:
        batch.step()
    _, cached = sequential(model, store, prompt + row.tokens + [5], 2)
    assert cached == len(prompt) + len(row.tokens) - 1
    store.check_integrity()
    store.detach()


def test_a_row_past_its_deadline_leaves_stored() -> None:
    """A row whose timeout passed ends with `timeout` at the next step, its tokens so far stored."""
    model = build("llama")
    store = PrefixCache(model)
    prompt = random_prompt(20, seed=9)[0].tolist()
    batch = RunningBatch(store)
    row = Row(Request(prompt, max_new_tokens=50, timeout_s=60.0))
    assert batch.admit(row)
    batch.step()
    batch.end_flagged(now=row.submitted_at + 61.0)
    assert row.end_reason is EndReason.TIMEOUT and not batch.rows
    _, cached = sequential(model, store, prompt + row.tokens + [5], 2)
    assert cached == len(prompt) + len(row.tokens) - 1
    store.detach()


def test_a_row_whose_new_positions_hold_nan_stores_nothing_past_what_was_stored() -> None:
    """A leaving row is checked for NaN or infinity before it is stored, as `generate` checks its own: a poisoned
    answer position keeps the whole turn out of the store (counted), and the prompt stored before stays reusable.
    The row's neighbour, clean, is stored whole."""
    model = build("llama")
    store = PrefixCache(model)
    system = random_prompt(24, seed=3)[0].tolist()
    sequential(model, store, system, 1)  # the shared prefix is stored: both rows restore it
    prompts = [system + random_prompt(6 + i, seed=30 + i)[0].tolist() for i in range(2)]
    batch = RunningBatch(store)
    rows = [Row(Request(p, max_new_tokens=50)) for p in prompts]
    assert all(batch.admit(row) for row in rows)
    for _ in range(3):
        batch.step()
    assert [row.cached_tokens for row in rows] == [24, 24]
    poisoned = rows[0]
    column = batch.length - 2  # an answer position of row 0 (fed, not restored)
    batch._cache.layers[0].keys[0, :, column] = float("nan")  # type: ignore[union-attr]  # a view of its room
    batch.end([(row, EndReason.CANCELLED) for row in rows])
    assert store.stats().fallbacks == {"non_finite_states": 1}
    _, cached = sequential(model, store, poisoned.fed_ids + [5], 1)
    assert cached == len(prompts[0])  # its prompt, stored when it joined; nothing of its answer
    clean = rows[1]
    _, cached = sequential(model, store, clean.fed_ids + [5], 1)
    assert cached == len(clean.fed_ids)
    store.check_integrity()
    store.detach()


def test_rows_restore_prefixes_moved_to_host_and_disk_and_reuse_as_much(tmp_path: Any) -> None:
    """A store whose device and host tiers hold 30 tokens each: the rows' entries move down to host memory and
    disk, and turn 2 (through the scheduler, prefilled in pieces of 4) restores them from there, with the tokens and
    `cached_tokens` of the sequential path on an unbounded store."""
    from hf_prefix_cache.batching.scheduler import Scheduler

    model = build("llama")
    _, prompts = chats()
    probe = PrefixCache(model)
    sequential(model, probe, prompts[0], 1)
    per_token = probe.stats().nbytes // len(prompts[0])
    probe.detach()
    tiered = PrefixCache(
        model, max_bytes=30 * per_token, max_host_bytes=30 * per_token, disk_dir=tmp_path, save_on_exit=False
    )
    reference = PrefixCache(model)
    rows = batched(tiered, [Request(p, max_new_tokens=5) for p in prompts])
    expected = [sequential(model, reference, p, 5) for p in prompts]
    assert [row.tokens for row in rows] == [tokens for tokens, _ in expected]
    moved = tiered.stats()
    assert moved.host_nbytes > 0 and moved.disk_nbytes > 0 and moved.device_nbytes <= 30 * per_token
    turns = [
        p + row.tokens + random_prompt(6, seed=60 + i)[0].tolist()
        for i, (p, row) in enumerate(zip(prompts, rows, strict=True))
    ]
    with Scheduler(tiered, prefill_chunk=4) as scheduler:
        again = [scheduler.submit(Request(turn, max_new_tokens=3)) for turn in turns]
        assert all(row.wait(timeout=120) for row in again)
    for turn, row in zip(turns, again, strict=True):
        assert (row.tokens, row.cached_tokens) == sequential(model, reference, turn, 3)
    assert sum(row.cached_tokens for row in again) > 0 and tiered.stats().reloads > 0
    for store in (tiered, reference):
        store.check_integrity()
        store.detach()
