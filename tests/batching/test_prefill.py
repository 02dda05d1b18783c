"""Chunked prefill: a row with many uncached prompt tokens is prefilled a piece per cycle, and the batch decodes between.

Each row's tokens equal `model.generate` on its prompt alone and its logits agree within LOGIT_TOL; the
chunked row's prompt is stored and counted as one served call (its restored tokens as `cached_tokens`);
a row cancelled mid-prefill keeps the part it fed, and nothing stays pinned.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import CACHE_NAME, LOGIT_TOL, build, random_prompt
from test_exactness import alone

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.api.prefix_cache import store_of
from hf_prefix_cache.batching.prefill import DEFAULT_CHUNK, wants_chunks
from hf_prefix_cache.batching.rows import EndReason, Request, Row
from hf_prefix_cache.batching.scheduler import Scheduler
from hf_prefix_cache.frontends.serve_args import DEFAULT_PREFILL_CHUNK


def assert_alone(model: Any, row: Row) -> None:
    prompt = list(row.request.ids)
    out = alone(model, prompt, row.request.max_new_tokens)
    assert row.tokens == out.sequences[0, len(prompt) :].tolist()
    assert max((a - b[0]).abs().max().item() for a, b in zip(row.logits, out.logits, strict=True)) < LOGIT_TOL


@pytest.mark.parametrize("kind", ["llama", "mistral", "gemma3_text", "gpt2"])
def test_a_long_prompt_is_prefilled_in_pieces_while_the_batch_decodes_and_every_row_is_exact(kind: str) -> None:
    """Two rows decode; a 70-token cold prompt arrives: 5 pieces of 16, one per cycle, each cycle also a step of
    the two (they gain a token per piece), then it joins; all three equal their requests alone. Full attention,
    sliding windows of 8 (Mistral; Gemma 3 with global layers too) and GPT-2's learned positions."""
    model = build(kind)
    store = PrefixCache(model)
    scheduler = Scheduler(store, prefill_chunk=16)
    short = [scheduler.submit(Request(random_prompt(12, seed=s)[0].tolist(), 20, keep_logits=True)) for s in (1, 2)]
    scheduler.cycle()
    long_prompt = random_prompt(70, seed=3)[0].tolist()
    long = scheduler.submit(Request(long_prompt, max_new_tokens=6, keep_logits=True))
    progress = []
    while not long.tokens:
        scheduler.cycle()
        progress.append([len(row.tokens) for row in short])
    assert len(progress) == 5 and scheduler.load().pieces == 5  # ceil(70 / 16) pieces, the last one joining
    assert [p[0] for p in progress] == list(range(3, 8))  # the others step once a piece
    scheduler.run_until_idle()
    for row in (*short, long):
        assert row.end_reason is EndReason.LENGTH
        assert_alone(model, row)
    assert long.cached_tokens == 0 and long.scope is not None and long.scope.prompt_tokens == 70
    with store.lookup(long_prompt) as hit:  # its prompt was stored (and its answer, as it left)
        assert hit.cached_len == 69
    assert store_of(store).num_pinned_nodes() == 0
    store.check_integrity()
    store.detach()


def test_a_chunked_row_restores_its_stored_prefix_first() -> None:
    """A prompt of a stored 40-token prefix and 50 new tokens: 40 restored (counted), the 50 fed in 4 pieces."""
    model = build("llama")
    store = PrefixCache(model)
    prefix = random_prompt(40, seed=4)[0].tolist()
    ids = torch.tensor([prefix])
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, **{CACHE_NAME: store})
    prompt = prefix + random_prompt(50, seed=5)[0].tolist()
    scheduler = Scheduler(store, prefill_chunk=16)
    assert wants_chunks(store, Row(Request(prompt, 1)), 16) and not wants_chunks(store, Row(Request(prompt, 1)), 64)
    row = scheduler.submit(Request(prompt, max_new_tokens=5, keep_logits=True))
    cycles = 0
    while not row.tokens:
        scheduler.cycle()
        cycles += 1
    scheduler.run_until_idle()
    assert cycles == 4 and row.cached_tokens == 40
    assert_alone(model, row)
    assert store.stats().hit_tokens == 40
    store.check_integrity()
    store.detach()


def cancel_after_two_pieces(store: PrefixCache, prompt: list[int]) -> Scheduler:
    """Submit `prompt` to a scheduler with pieces of 16, cancel it after two cycles, run on: it ends cancelled, unanswered."""
    scheduler = Scheduler(store, prefill_chunk=16)
    row = scheduler.submit(Request(prompt, max_new_tokens=5))
    scheduler.cycle()
    scheduler.cycle()
    row.cancel()
    scheduler.run_until_idle()
    assert row.end_reason is EndReason.CANCELLED and row.tokens == []
    return scheduler


def test_a_row_cancelled_mid_prefill_keeps_what_it_fed_and_pins_nothing() -> None:
    """Cancelled after two of its pieces: it ends cancelled with no token, its 32 fed tokens stored, nothing pinned;
    a timeout likewise; `stop` ends a row still prefilling."""
    model = build("llama")
    store = PrefixCache(model)
    prompt = random_prompt(80, seed=6)[0].tolist()
    scheduler = cancel_after_two_pieces(store, prompt)
    with store.lookup(prompt) as hit:
        assert hit.cached_len == 32
    late = scheduler.submit(Request(random_prompt(60, seed=7)[0].tolist(), max_new_tokens=5, timeout_s=0.0))
    scheduler.run_until_idle()
    assert late.end_reason is EndReason.TIMEOUT
    with Scheduler(store, prefill_chunk=8) as running:
        stopped = running.submit(Request(random_prompt(400, seed=8)[0].tolist(), max_new_tokens=5))
    assert stopped.wait(timeout=60) and stopped.end_reason is EndReason.CANCELLED
    assert store_of(store).num_pinned_nodes() == 0
    store.check_integrity()
    store.detach()


def test_rows_sharing_an_uncached_prompt_compute_it_once() -> None:
    """Three rows arrive at once, two with the same 60-token cold prompt, one with another: one prefills in pieces at
    a time, so the second of the pair restores the first's stored prompt (59 tokens, as one at a time reports) and
    joins whole; all are exact."""
    model = build("llama")
    store = PrefixCache(model)
    shared, other = random_prompt(60, seed=11)[0].tolist(), random_prompt(50, seed=12)[0].tolist()
    scheduler = Scheduler(store, prefill_chunk=16)
    rows = [scheduler.submit(Request(p, max_new_tokens=4, keep_logits=True)) for p in (shared, other, shared)]
    scheduler.run_until_idle()
    assert [row.cached_tokens for row in rows] == [0, 0, 59]
    assert store.stats().computed_tokens == 60 + 50 + 1
    for row in rows:
        assert_alone(model, row)
    store.detach()


def test_a_restore_the_store_refuses_prefills_the_row_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the restore for pieces raises (a guard of the store), the row is admitted whole through `generate`,
    which falls back as it always does: it answers exactly, no piece prefilled."""
    from hf_prefix_cache.errors import InconsistentStateError

    model = build("llama")
    store = PrefixCache(model)

    def refused(*args: Any) -> Any:
        raise InconsistentStateError("a guard failed")

    monkeypatch.setattr(store, "lookup", refused)
    scheduler = Scheduler(store, prefill_chunk=16)
    row = scheduler.submit(Request(random_prompt(70, seed=13)[0].tolist(), max_new_tokens=4, keep_logits=True))
    scheduler.run_until_idle()
    assert row.end_reason is EndReason.LENGTH and scheduler.load().pieces == 0
    assert_alone(model, row)
    store.detach()


def test_chunking_is_off_at_zero_and_refused_below() -> None:
    model = build("llama")
    store = PrefixCache(model)
    row = Row(Request(random_prompt(70, seed=9)[0].tolist(), 1))
    assert wants_chunks(store, row, 16) and not wants_chunks(store, row, 0)
    with pytest.raises(ValueError, match="prefill_chunk"):
        Scheduler(store, prefill_chunk=-1)
    assert DEFAULT_PREFILL_CHUNK == DEFAULT_CHUNK  # serve's default is the library's
    store.detach()


def restore_points(store: PrefixCache, prompt: list[int]) -> list[int]:
    """How much of each leading part of `prompt` the store restores (its snapshots decide, for recurrent states)."""
    points = []
    for end in range(1, len(prompt) + 1):
        with store.lookup(prompt[:end]) as hit:
            points.append(hit.cached_len)
    return points


@pytest.mark.parametrize("kind", ["qwen3_next", "lfm2"])
def test_recurrent_and_conv_rows_prefill_in_pieces_exactly_and_snapshot_where_generate_would(kind: str) -> None:
    """Linear-attention (Qwen3-Next) and conv (LFM2) hybrids: a 40-token system prompt is stored with one question
    by `generate`; a 100-token prompt with another question arrives while two rows decode. It restores the stored
    snapshot at 32 and is fed its other 68 tokens in 5 pieces of 16 (each also cut at the snapshot bounds inside it),
    the two rows gaining a token a piece, and every row equals its request alone. Its snapshots (the divergence at 40, every 32 tokens,
    before its last token) are where `generate`'s own prefill through a store puts them: every leading part of the
    prompt restores as far on both stores, and a third question restores the 40 shared tokens."""
    model = build(kind)
    system, asked = random_prompt(40, seed=20)[0].tolist(), random_prompt(30, seed=21)[0].tolist()
    prompt = system + random_prompt(60, seed=22)[0].tolist()
    stores = {way: PrefixCache(model, snapshot_interval=32) for way in ("pieces", "generate")}
    for store in stores.values():  # the system prompt stored with a first question, as generate stores it
        ids = torch.tensor([system + asked])
        model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, **{CACHE_NAME: store}
        )
    store = stores["pieces"]
    scheduler = Scheduler(store, prefill_chunk=16)
    short = [scheduler.submit(Request(random_prompt(12, seed=s)[0].tolist(), 20, keep_logits=True)) for s in (1, 2)]
    scheduler.cycle()
    assert wants_chunks(store, Row(Request(prompt, 1)), 16)
    long = scheduler.submit(Request(prompt, max_new_tokens=6, keep_logits=True))
    progress = []
    while not long.tokens:
        scheduler.cycle()
        progress.append(len(short[0].tokens))
    assert scheduler.load().pieces == 5 and progress == list(range(3, 8))  # ceil(68 / 16) pieces
    scheduler.run_until_idle()
    for row in (*short, long):
        assert row.end_reason is EndReason.LENGTH
        assert_alone(model, row)
    assert long.cached_tokens == 32  # the interval snapshot of the stored system prompt and question
    ids = torch.tensor([prompt])
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
                   **{CACHE_NAME: stores["generate"]})  # fmt: skip
    assert restore_points(store, prompt) == restore_points(stores["generate"], prompt)
    third = system + random_prompt(20, seed=23)[0].tolist()
    with store.lookup(third) as hit:
        assert hit.cached_len == 40  # the snapshot where the prompt left the stored one
    for each in stores.values():
        assert store_of(each).num_pinned_nodes() == 0
        each.check_integrity()
        each.detach()


def test_a_recurrent_row_cancelled_mid_prefill_stores_its_fed_part_with_its_snapshots() -> None:
    """Qwen3-Next, snapshots every 8 tokens, pieces of 16: cancelled after two pieces, its 32 fed tokens are stored
    with the snapshots at 8, 16 and 24 (the insert takes 32 itself); nothing stays pinned."""
    model = build("qwen3_next")
    store = PrefixCache(model, snapshot_interval=8)
    prompt = random_prompt(80, seed=24)[0].tolist()
    cancel_after_two_pieces(store, prompt)
    points = restore_points(store, prompt[:40])
    assert [points[end - 1] for end in (9, 17, 25, 33, 40)] == [8, 16, 24, 32, 32]
    assert store_of(store).num_pinned_nodes() == 0
    store.check_integrity()
    store.detach()
