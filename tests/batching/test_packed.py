"""Packed steps (`batching/packed.py`): rows joining in the decoding rows' own forward equal each request alone.

Rows are staged with their stored prefixes restored, then one forward feeds the decoding rows' next tokens and
every staged row's uncached prompt tokens. Each row's tokens equal `generate` alone and its logits agree within
LOGIT_TOL, its prompt is stored and counted as `generate` counts it, and a row the packed step cannot take
(nothing stored, a model with windows, a row with media) is left to the prefill of its own.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import CACHE_NAME, LOGIT_TOL, build, random_prompt
from test_exactness import alone

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.api.prefix_cache import store_of
from hf_prefix_cache.batching import packed
from hf_prefix_cache.batching.batch import DEFER_MIN, SHARED_MIN, RunningBatch, Staging
from hf_prefix_cache.batching.growing import LEFT_SPARE, GrowingCache
from hf_prefix_cache.batching.rows import EndReason, Request, Row
from hf_prefix_cache.batching.scheduler import Scheduler


def _model(name: str) -> Any:
    kind, _, attention = name.partition(":")
    model = build(kind)
    if attention:
        model.set_attn_implementation(attention)
    return model


@pytest.fixture(scope="module", params=("llama:sdpa", "llama", "gpt2"))
def model(request: pytest.FixtureRequest) -> Any:
    return _model(request.param)


def _stored(model: Any, store: PrefixCache, ids: list[int]) -> None:
    model.generate(torch.tensor([ids]), max_new_tokens=1, **{CACHE_NAME: store})


def _equal_alone(model: Any, rows: list[Row]) -> None:
    for row in rows:
        prompt = list(row.request.ids)
        cold = alone(model, prompt, len(row.tokens))
        assert row.tokens == cold.sequences[0, len(prompt) :].tolist()
        assert max((a - b[0]).abs().max().item() for a, b in zip(row.logits, cold.logits, strict=True)) < LOGIT_TOL


def test_rows_joining_in_a_step_equal_each_request_alone(model: Any) -> None:
    """Two rows join in one step while a row decodes (one with a single new token), then two more, one of them
    longer than the batch by more than its spare columns: every row equals its request alone, and each staged
    row's prompt is stored by its step, its restored prefix counted as `generate` counts it."""
    store = PrefixCache(model)
    base = random_prompt(40, seed=1)[0].tolist()
    _stored(model, store, base)
    prompts = [base + random_prompt(k, seed=10 + k)[0].tolist() for k in (3, 7, 1, 12)]
    prompts.append(base[:20] + random_prompt(LEFT_SPARE + 60, seed=5)[0].tolist())
    news = (9, 6, 8, 4, 5)
    rows = [Row(Request(p, max_new_tokens=n, keep_logits=True)) for p, n in zip(prompts, news, strict=True)]
    batch = RunningBatch(store)
    assert batch.admit(rows[0])  # its own prefill
    batch.step()
    assert batch.stage(rows[1]) is batch.stage(rows[2]) is Staging.STAGED and batch.held() == 3 and len(batch.rows) == 1
    batch.step()
    namespace = store_of(store).namespace()
    assert [store_of(store).stored_len(namespace, p) for p in prompts[1:3]] == [len(p) for p in prompts[1:3]]
    assert [len(row.tokens) for row in rows[:3]] == [3, 1, 1]
    batch.step()
    assert batch.stage(rows[3]) is batch.stage(rows[4]) is Staging.STAGED
    while batch.held():
        batch.step()
    _equal_alone(model, rows)
    assert [row.cached_tokens for row in rows] == [40, 40, 40, 40, 20]
    assert all(row.end_reason is EndReason.LENGTH for row in rows)
    assert store_of(store).num_pinned_nodes() == 0
    store.check_integrity()
    store.detach()


def test_the_scheduler_joins_arrivals_in_its_steps_and_counts_them() -> None:
    """Rows sharing a stored prefix, submitted together, join in steps (`joined_in_step`) and answer as `generate`
    does. Two of them share DEFER_MIN more tokens than the store holds: the second waits a step and restores the
    first's prompt, so every row's cached tokens and the store's stats are what a sequential store reports (the
    others share fewer). With `pack_joins=False` none joins in a step, with the same answers and counts."""
    model = _model("llama:sdpa")
    base = random_prompt(50, seed=3)[0].tolist()
    extension = random_prompt(DEFER_MIN, seed=40)[0].tolist()
    tails = [random_prompt(k, seed=20 + k)[0].tolist() for k in (5, 9, 2, 14)]
    prompts = [base + tails[0], base + extension + tails[1], base + extension + tails[2], base + tails[3]]
    assert len({p[len(base)] for p in (prompts[0], prompts[1], prompts[3])}) == 3  # only the extension is shared
    sequential = PrefixCache(model)
    _stored(model, sequential, base)
    expected = []
    for prompt in prompts:
        with sequential.request() as scope:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, **{CACHE_NAME: sequential})
        expected.append((out[0, len(prompt) :].tolist(), scope.cached_tokens))
    beyond = next(i for i, (a, b) in enumerate(zip(tails[1], tails[2], strict=False)) if a != b)
    assert [cached for _, cached in expected] == [50, 50, 50 + DEFER_MIN + beyond, 50]
    for pack in (True, False):
        store = PrefixCache(model)
        _stored(model, store, base)
        scheduler = Scheduler(store, pack_joins=pack)
        rows = [scheduler.submit(Request(p, max_new_tokens=6)) for p in prompts]
        scheduler.run_until_idle()
        assert [(row.tokens, row.cached_tokens) for row in rows] == expected
        assert scheduler.joined_in_step == (len(prompts) if pack else 0)
        counted = [(s.requests, s.prompt_tokens, s.hit_tokens) for s in (store.stats(), sequential.stats())]
        assert counted[0] == counted[1]
        store.detach()
    sequential.detach()


def test_rows_the_packed_step_cannot_take_join_by_a_prefill_of_their_own() -> None:
    """Nothing stored, or a model with sliding windows: `stage` declines, counting and pinning nothing, and `admit`
    joins the row as before. A prompt stored whole is staged with its last token to feed, as `generate` feeds it."""
    model = _model("llama:sdpa")
    store = PrefixCache(model)
    prompt = random_prompt(30, seed=4)[0].tolist()
    batch = RunningBatch(store)
    cold = Row(Request(prompt, max_new_tokens=3))
    assert batch.stage(cold) is Staging.OWN_PREFILL and batch.held() == 0 and store.stats().prompt_tokens == 0
    assert batch.admit(cold)
    while batch.rows:
        batch.step()
    again = Row(Request(prompt, max_new_tokens=3, keep_logits=True))  # whole prompt stored: its last token is fed
    assert batch.stage(again) is Staging.STAGED
    while batch.held():
        batch.step()
    _equal_alone(model, [again])
    assert again.cached_tokens == len(prompt) - 1 and store_of(store).num_pinned_nodes() == 0
    store.detach()
    windows = _model("mistral")
    other = PrefixCache(windows)
    _stored(windows, other, prompt)
    assert RunningBatch(other).stage(Row(Request([*prompt, 5, 6], max_new_tokens=3))) is Staging.OWN_PREFILL
    other.detach()


def test_a_packed_step_that_fails_ends_its_rows_and_unpins_their_prefixes() -> None:
    """A staged row whose new token is no id of the model fails the step's forward: every row ends with the error,
    no prefix stays pinned, the store passes its integrity check, and the next rows run."""
    model = _model("llama:sdpa")
    store = PrefixCache(model)
    base = random_prompt(30, seed=6)[0].tolist()
    _stored(model, store, base)
    scheduler = Scheduler(store)
    bad = scheduler.submit(Request([*base, model.config.vocab_size + 5], max_new_tokens=3))
    good = scheduler.submit(Request([*base, 7], max_new_tokens=3))
    scheduler.run_until_idle()
    assert bad.end_reason is EndReason.ERROR and good.end_reason is EndReason.ERROR
    assert store_of(store).num_pinned_nodes() == 0
    store.check_integrity()
    after = scheduler.submit(Request([*base, 8], max_new_tokens=3))
    scheduler.run_until_idle()
    assert after.end_reason is EndReason.LENGTH and len(after.tokens) == 3
    store.detach()


def test_random_arrivals_cancellations_and_departures_stay_exact() -> None:
    """Thirty rows over a shared stored prefix arrive at random steps, several at once (staged together, or by
    their own prefill where nothing of theirs is stored), some longer than the batch, some cancelled mid-answer:
    every row that ran to its end equals its request alone, nothing stays pinned, the store passes its check."""
    model = _model("llama:sdpa")
    store = PrefixCache(model)
    gen = torch.Generator().manual_seed(7)
    base = random_prompt(SHARED_MIN + 16, seed=8)[0].tolist()  # rows restoring all of it decode it once a step
    _stored(model, store, base)

    def draw(high: int) -> int:
        return int(torch.randint(0, high, (1,), generator=gen))

    requests = []
    for i in range(30):
        kept = [0, 12, len(base), len(base), len(base)][draw(5)]  # 0: nothing stored under it
        tail = random_prompt(1 + draw(40 if i % 7 else LEFT_SPARE + 40), seed=100 + i)[0].tolist()
        requests.append(Request(base[:kept] + tail, max_new_tokens=1 + draw(12), keep_logits=True))
    scheduler = Scheduler(store)
    arrivals = sorted((draw(40), i) for i in range(30))
    rows: list[Row] = []
    step = 0
    while arrivals or scheduler.batch.held() or scheduler.load().waiting:
        while arrivals and arrivals[0][0] <= step:
            rows.append(scheduler.submit(requests[arrivals.pop(0)[1]]))
        if step % 9 == 4 and scheduler.batch.rows:
            scheduler.batch.rows[draw(len(scheduler.batch.rows))].cancel()
        scheduler.cycle()
        step += 1
    assert scheduler.joined_in_step > 5
    finished = [row for row in rows if row.end_reason is not EndReason.CANCELLED]
    assert len(finished) > 15 and all(row.end_reason is EndReason.LENGTH for row in finished)
    _equal_alone(model, finished)
    assert store_of(store).num_pinned_nodes() == 0
    store.check_integrity()
    store.detach()


def test_cascade_equals_attention_over_each_rows_own_columns() -> None:
    """`packed.cascade` (the shared positions read once, from row 0, joined by log-sum-exp with each row's own) gives
    what sdpa gives over each row's own columns, rows behind different padding, grouped heads."""
    gen = torch.Generator().manual_seed(0)
    rows, kv_heads, group, dim, shared, columns = 3, 2, 3, 16, 40, 70
    pads = torch.tensor([0, 9, 4])
    key, value = (torch.randn(rows, kv_heads, columns, dim, generator=gen) for _ in range(2))
    for i in range(1, rows):  # the shared positions alike, each row's from its padding on
        p = int(pads[i])
        key[i, :, p : p + shared], value[i, :, p : p + shared] = key[0, :, :shared], value[0, :, :shared]
    query = torch.randn(rows, kv_heads * group, 1, dim, generator=gen)
    out = packed.cascade(query, key, value, pads, shared, 0.25)
    for i in range(rows):
        k, v = (t[i : i + 1, :, int(pads[i]) :].repeat_interleave(group, dim=1) for t in (key, value))
        expected = torch.nn.functional.scaled_dot_product_attention(query[i : i + 1], k, v, scale=0.25)
        assert (out[i, 0] - expected[0, :, 0]).abs().max().item() < 1e-5


@pytest.mark.parametrize("name", ["llama:sdpa", "llama"])
def test_rows_sharing_a_long_prefix_attend_it_once_and_stay_exact(name: str) -> None:
    """Rows restoring one stored prefix of SHARED_MIN + 30 positions (checked alike in every layer) attend it once a
    step (`packed.cascade`), joining and leaving: each equals its request alone. A row whose keys over that prefix
    differ in one element turns it off: the batch then attends each row's own columns."""
    model = _model(name)
    store = PrefixCache(model)
    base = random_prompt(SHARED_MIN + 30, seed=11)[0].tolist()
    _stored(model, store, base)
    prompts = [base + random_prompt(k, seed=30 + k)[0].tolist() for k in (4, 9, 1, 6)]
    rows = [Row(Request(p, max_new_tokens=n, keep_logits=True)) for p, n in zip(prompts, (10, 4, 8, 6), strict=True)]
    batch = RunningBatch(store)
    assert batch.admit(rows[0]) and batch.admit(rows[1])
    batch.step()
    assert batch._shared == len(base)
    assert batch.stage(rows[2]) is Staging.STAGED
    batch.step()
    assert batch._shared == len(base)
    run_rest = [rows[3]]
    while batch.held() or run_rest:
        if len(rows[0].tokens) == 6 and run_rest:
            assert batch.admit(run_rest.pop())
        batch.step()
    _equal_alone(model, rows)
    other = [Row(Request(p, max_new_tokens=3)) for p in prompts[:2]]
    assert batch.admit(other[0]) and batch.admit(other[1])
    cache = batch._cache
    assert isinstance(cache, GrowingCache)
    cache.layers[1].keys[1, 0, other[1].pad + 5, 0] += 1e-3  # one element of the second row's shared part
    batch.step()
    assert batch._shared == 0
    store.detach()


def test_a_prompt_stored_by_a_packed_step_holds_no_memory_of_the_batch() -> None:
    """The batch's buffers are reused (rows move into leaving rows' places, new rows are written over old ones):
    a prompt stored by a packed step must own its tensors. With every buffer of the batch zeroed after the step,
    the next request over that prompt still restores it exactly (its logits equal a cold run's)."""
    model = _model("llama:sdpa")
    store = PrefixCache(model)
    base = random_prompt(40, seed=12)[0].tolist()
    _stored(model, store, base)
    prompt = base + random_prompt(9, seed=13)[0].tolist()
    batch = RunningBatch(store)
    row = Row(Request(prompt, max_new_tokens=5))
    assert batch.stage(row) is Staging.STAGED
    batch.step()
    cache = batch._cache
    assert isinstance(cache, GrowingCache)
    for room in cache._rooms.values():
        room.keys.zero_()
        room.values.zero_()
    longer = [*prompt, 7, 8]
    with store.request() as scope:
        cached = alone(model, longer, 4, **{CACHE_NAME: store})
    cold = alone(model, longer, 4)
    assert scope.cached_tokens == len(prompt)
    assert cached.sequences.tolist() == cold.sequences.tolist()
    assert max((a - b).abs().max().item() for a, b in zip(cached.logits, cold.logits, strict=True)) < LOGIT_TOL
    store.detach()


def test_rows_joining_together_grow_the_batch_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seven rows staged while one decodes: each layer's buffers are copied once to hold all eight (doubling one
    join at a time copied the batch three times), and every row still equals its request alone."""
    from hf_prefix_cache.batching import growing

    copies: list[int] = []
    regrown = growing.Room.regrown

    def counted(room: growing.Room, rows: int, before: int, after: int) -> growing.Room:
        copies.append(rows)
        return regrown(room, rows, before, after)

    monkeypatch.setattr(growing.Room, "regrown", counted)
    model = _model("llama:sdpa")
    store = PrefixCache(model)
    base = random_prompt(40, seed=3)[0].tolist()
    _stored(model, store, base)
    prompts = [base + random_prompt(2 + k, seed=30 + k)[0].tolist() for k in range(8)]
    rows = [Row(Request(p, max_new_tokens=3, keep_logits=True)) for p in prompts]
    batch = RunningBatch(store)
    assert batch.admit(rows[0])
    copies.clear()
    assert all(batch.stage(row) is Staging.STAGED for row in rows[1:])
    batch.step()
    layers = len(store_of(store).profile.kv_layers)
    assert copies == [8] * layers
    while batch.held():
        batch.step()
    _equal_alone(model, rows)
    assert store_of(store).num_pinned_nodes() == 0
    store.detach()
