"""The running batch is exact: rows joining and leaving at different steps equal each request run alone.

Each row's tokens equal `model.generate` on its prompt alone (cold, and through a store), and its per-step
logits agree with the cold run's within LOGIT_TOL (the tolerance of the suite's padded batches). Tiny
random-weight models of each kind the batch takes: full attention, sliding windows, hybrids with linear
or conv layers.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import CACHE_NAME, LOGIT_TOL, build, random_prompt

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.batching.batch import RunningBatch
from hf_prefix_cache.batching.growing import LEFT_SPARE, SPARE
from hf_prefix_cache.batching.rows import EndReason, Request, Row

MODELS = ("llama", "gpt2", "mistral", "gemma3_text", "qwen3_next", "lfm2")
# (prompt length, seed, max_new_tokens, steps run before it joins)
ROWS = ((30, 1, 7, 0), (22, 2, 9, 2), (41, 3, 3, 3), (17, 4, 6, 3))


def alone(model: Any, prompt: list[int], new: int, **kwargs: Any) -> Any:
    ids = torch.tensor([prompt])
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )


def run_staggered(batch: RunningBatch, rows: list[Row], joins_after: list[int]) -> None:
    """Admit each row after its number of steps, then step until every row has left."""
    steps = 0
    pending = list(zip(rows, joins_after, strict=True))
    while pending or batch.rows:
        while pending and pending[0][1] <= steps:
            assert batch.admit(pending.pop(0)[0])
        batch.step()
        steps += 1


@pytest.fixture(scope="module", params=MODELS)
def model(request: pytest.FixtureRequest) -> Any:
    return build(request.param)


def test_rows_joining_and_leaving_equal_each_request_alone(model: Any) -> None:
    """Rows admitted at steps 0, 2, 3, 3 and ending at different steps: tokens equal, logits within tolerance."""
    store = PrefixCache(model)
    prompts = [random_prompt(n, seed=seed)[0].tolist() for n, seed, _, _ in ROWS]
    rows = [
        Row(Request(p, max_new_tokens=new, keep_logits=True)) for p, (_, _, new, _) in zip(prompts, ROWS, strict=True)
    ]
    run_staggered(RunningBatch(store), rows, [after for *_, after in ROWS])
    for prompt, row, (_, _, new, _) in zip(prompts, rows, ROWS, strict=True):
        cold = alone(model, prompt, new)
        assert row.tokens == cold.sequences[0, len(prompt) :].tolist()
        assert row.end_reason is EndReason.LENGTH
        diff = max((a - b[0]).abs().max().item() for a, b in zip(row.logits, cold.logits, strict=True))
        assert diff < LOGIT_TOL
        cached = alone(model, prompt, new, **{CACHE_NAME: store})  # the store path, after the batch stored the row
        assert row.tokens == cached.sequences[0, len(prompt) :].tolist()
    store.check_integrity()
    store.detach()


def test_a_row_ends_at_its_end_token_as_generate_does(model: Any) -> None:
    """A row given an end id that its answer reaches leaves there (the end token kept), while the others go on."""
    store = PrefixCache(model)
    prompts = [random_prompt(n, seed=seed)[0].tolist() for n, seed, _, _ in ROWS[:2]]
    cold = [alone(model, p, 8).sequences[0, len(p) :].tolist() for p in prompts]
    end = cold[0][3]
    rows = [Row(Request(prompts[0], max_new_tokens=8, end_ids=frozenset({end}))), Row(Request(prompts[1], 8))]
    run_staggered(RunningBatch(store), rows, [0, 1])
    expected = alone(model, prompts[0], 8, eos_token_id=end, pad_token_id=0).sequences[0, len(prompts[0]) :].tolist()
    assert rows[0].tokens == expected == cold[0][: cold[0].index(end) + 1]
    assert rows[0].end_reason is EndReason.EOS
    assert rows[1].tokens == cold[1] and rows[1].end_reason is EndReason.LENGTH
    store.detach()


def test_stop_sequences_and_a_one_token_answer(model: Any) -> None:
    """A stop sequence ends a row after it (kept); a one-token answer ends at admission without joining."""
    store = PrefixCache(model)
    prompt = random_prompt(26, seed=7)[0].tolist()
    cold = alone(model, prompt, 8).sequences[0, len(prompt) :].tolist()
    batch = RunningBatch(store)
    one = Row(Request(prompt, max_new_tokens=1))
    sequence = tuple(cold[2:4])
    stop = Row(Request(prompt, max_new_tokens=8, stop_sequences=(sequence,)))
    assert batch.admit(one) and not batch.rows and one.tokens == cold[:1]
    run_staggered(batch, [stop], [0])
    first = next(j for j in range(len(cold) - 1) if tuple(cold[j : j + 2]) == sequence)
    assert stop.end_reason is EndReason.STOP and stop.tokens == cold[: first + 2]
    store.detach()


def test_rows_decoding_past_their_layers_spare_room_stay_exact() -> None:
    """Full-attention layers grow in place (`growing.py`): answers longer than the spare room (copied when
    outgrown), with rows leaving and joining in between, equal each request alone."""
    model = build("llama")
    store = PrefixCache(model)
    prompts = [random_prompt(n, seed=seed)[0].tolist() for n, seed in ((20, 1), (9, 2), (14, 3))]
    new = (2 * SPARE + 8, 5, SPARE // 2)  # the first decodes alone for more than SPARE steps at the end
    rows = [Row(Request(p, max_new_tokens=n, keep_logits=True)) for p, n in zip(prompts, new, strict=True)]
    run_staggered(RunningBatch(store), rows, [0, 3, 10])
    for prompt, n, row in zip(prompts, new, rows, strict=True):
        cold = alone(model, prompt, n)
        assert row.tokens == cold.sequences[0, len(prompt) :].tolist()
        assert max((a - b[0]).abs().max().item() for a, b in zip(row.logits, cold.logits, strict=True)) < LOGIT_TOL
    store.detach()


def test_rows_join_and_leave_in_place_and_stay_exact() -> None:
    """Where every layer is plain full attention, rows join and leave inside the batch's buffers
    (`GrowingCache.add_row`, `drop_rows`): a shorter row joining a batch with a free row copies nothing else
    (the buffers stay the same memory); a row longer than the spare columns before, and more rows than the
    buffers have room for, copy the batch once. Every row equals its request alone."""
    model = build("llama")
    store = PrefixCache(model)
    # (prompt length, new tokens): the 2nd is LEFT_SPARE + 20 longer than the 1st
    plan = ((12, 9), (12 + LEFT_SPARE + 20, 12), (30, 4), (25, 14), (8, 3), (40, 6))
    prompts = [random_prompt(n, seed=50 + i)[0].tolist() for i, (n, _) in enumerate(plan)]
    rows = [Row(Request(p, max_new_tokens=new, keep_logits=True)) for p, (_, new) in zip(prompts, plan, strict=True)]
    batch = RunningBatch(store)
    assert all(batch.admit(row) for row in rows[:3])  # wider than the room, then more rows: copies (room for 4)
    batch.step()
    memory = batch._cache.layers[0].keys.untyped_storage().data_ptr() if batch._cache is not None else None
    assert batch.admit(rows[3])  # shorter, and a free row: written in place
    assert batch._cache is not None and batch._cache.layers[0].keys.untyped_storage().data_ptr() == memory
    run_staggered(batch, rows[4:], [0, 1])  # the fifth row outgrows the room for 4; rows leave mid-batch
    for prompt, row, (_, new) in zip(prompts, rows, plan, strict=True):
        cold = alone(model, prompt, new)
        assert row.tokens == cold.sequences[0, len(prompt) :].tolist()
        assert max((a - b[0]).abs().max().item() for a, b in zip(row.logits, cold.logits, strict=True)) < LOGIT_TOL
    store.check_integrity()
    store.detach()


def test_a_row_leaving_keeps_the_buffers() -> None:
    """A row leaving the middle of a full-attention batch takes no copy of the batch: the last row moves
    into its place, and the rows left go on exactly."""
    model = build("llama")
    store = PrefixCache(model)
    prompts = [random_prompt(n, seed=70 + n)[0].tolist() for n in (15, 22, 18)]
    rows = [Row(Request(p, max_new_tokens=new, keep_logits=True)) for p, new in zip(prompts, (8, 2, 8), strict=True)]
    batch = RunningBatch(store)
    assert all(batch.admit(row) for row in rows)
    memory = batch._cache.layers[0].keys.untyped_storage().data_ptr() if batch._cache is not None else None
    batch.step()  # the middle row ends (its second token)
    assert rows[1].end_reason is EndReason.LENGTH and [r is rows[2] for r in batch.rows] == [False, True]
    assert batch._cache is not None and batch._cache.layers[0].keys.untyped_storage().data_ptr() == memory
    while batch.rows:
        batch.step()
    for prompt, row in zip(prompts, rows, strict=True):
        cold = alone(model, prompt, len(row.tokens))
        assert row.tokens == cold.sequences[0, len(prompt) :].tolist()
        assert max((a - b[0]).abs().max().item() for a, b in zip(row.logits, cold.logits, strict=True)) < LOGIT_TOL
    store.detach()
