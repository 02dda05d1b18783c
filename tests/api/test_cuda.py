"""On a CUDA device: every cache layer type restores exactly on the GPU, through every tier and a restart.

Skipped without CUDA (CI has none); run on a GPU machine with ``pytest -m cuda``. The same logic
runs on the CPU in `test_exactness.py` and `test_tiers.py`; here it runs with tensors on the GPU,
pinned host copies, the side-stream mover and disk files written from GPU tensors.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import Hits, assert_same_as_cold, distinct_prompt, generate, kv_bytes_per_token, random_prompt

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.tiny_models import FULL_ATTENTION, HYBRID, RECURRENT, SLIDING, build

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ALL = FULL_ATTENTION + SLIDING + HYBRID + RECURRENT


@pytest.mark.parametrize("name", ALL)
def test_chat_turns_on_the_gpu_equal_cold_runs(name: str) -> None:
    """A three-turn chat on the GPU reuses the previous turn and equals cold runs, tokens and logits."""
    model = build(name).to("cuda")
    store = PrefixCache(model, snapshot_interval=16)
    hits = Hits(store)
    try:
        ids = random_prompt(40, seed=3).cuda()
        for turn in range(3):
            out = assert_same_as_cold(model, ids, store)
            if turn:
                assert hits.last() > 0, f"{name}: turn {turn} reused nothing"
            else:
                hits.last()
            ids = torch.cat([out.sequences, random_prompt(9, seed=10 + turn).cuda()], 1)
        store.check_integrity()
    finally:
        store.detach()


@pytest.mark.parametrize("name", ["llama", "gemma2", "bamba", "mamba2"])
def test_gpu_entries_through_host_and_disk_and_a_restart(name: str, tmp_path: Any) -> None:
    """Entries pushed from the GPU to pinned host memory and disk come back exactly, also in a new store."""
    model = build(name).to("cuda")
    per_token = kv_bytes_per_token(model) if name in ("llama", "gemma2") else 4096
    store = PrefixCache(model, max_device_bytes=40 * per_token, max_host_bytes=60 * per_token, disk_dir=tmp_path)
    prompts = [distinct_prompt(seed, n=40).cuda() for seed in range(5)]
    try:
        for p in prompts:
            generate(model, p, past_key_values=store)
        for p in prompts[:2]:
            assert_same_as_cold(model, p, store)
        store.check_integrity()
        store.save()
    finally:
        store.detach()
    fresh = PrefixCache(model, disk_dir=tmp_path)
    hits = Hits(fresh)
    try:
        assert_same_as_cold(model, prompts[-1], fresh)
        assert hits.last() > 0, f"{name}: nothing reused from disk after a restart"
    finally:
        fresh.detach()


def test_bfloat16_on_the_gpu_gives_the_same_tokens() -> None:
    """In bfloat16 on the GPU the cached answer has the same tokens as a cold run on a three-turn chat."""
    model = build("llama").to("cuda", torch.bfloat16)
    store = PrefixCache(model)
    try:
        ids = random_prompt(60, seed=5).cuda()
        for turn in range(3):
            cold = generate(model, ids, 8)
            warm = generate(model, ids, 8, past_key_values=store)
            assert torch.equal(cold.sequences, warm.sequences)
            ids = torch.cat([warm.sequences, random_prompt(7, seed=20 + turn).cuda()], 1)
    finally:
        store.detach()
