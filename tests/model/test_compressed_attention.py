"""DeepSeek-V4's compressed attention (`DeepseekV4HCACache`, `DeepseekV4CSACache`) served from snapshots.

Each test compares the store's run with a cold run (tokens equal, logits within `LOGIT_TOL`) and
counts the hit tokens. Snapshot intervals that are not multiples of the compress rates make chunks
end inside an open compression window, so a restore must bring back the window's buffered tokens
(and a CSA layer's overlap slice) as well as the compressed entries.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import CACHE_NAME, Hits, assert_same_as_cold, random_prompt

from hf_prefix_cache import PrefixCache, reasons
from hf_prefix_cache.model.profile import profile_model
from hf_prefix_cache.testing.compare import served
from hf_prefix_cache.testing.snapshots import divergences, second_turn_and_repeat
from hf_prefix_cache.testing.tiny_build import seeded

HCA_RATE, CSA_RATE, TOP_K = 8, 4, 16  # the CSA indexer keeps every entry up to TOP_K * CSA_RATE = 64 tokens
INTERVAL = 6  # snapshot bounds inside open windows of both compressors


@functools.cache
def _tiny_deepseek_v4() -> Any:
    """A float32 DeepSeek-V4 of three layers: sliding, heavily compressed (HCA) and compressed sparse (CSA)."""
    config = transformers.DeepseekV4Config(
        vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
        qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, num_hidden_layers=3,
        layer_types=["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"], n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, n_shared_experts=1, sliding_window=8, index_topk=TOP_K, index_n_heads=4,
        index_head_dim=16, compress_rates={"heavily_compressed_attention": HCA_RATE, "compressed_sparse_attention": CSA_RATE},
        pad_token_id=0, bos_token_id=1, eos_token_id=None,
    )  # fmt: skip
    return seeded(transformers.DeepseekV4ForCausalLM, config)


def test_both_compressed_layer_classes_are_served() -> None:
    profile = profile_model(_tiny_deepseek_v4())
    assert profile.unsupported is None and profile.has_state and profile.has_recurrence
    assert profile.exact_prompt_len == TOP_K * CSA_RATE


def test_a_second_turn_and_a_repeat_reuse_the_stored_prompt_exactly() -> None:
    model = _tiny_deepseek_v4()
    with served(model, clean=False, snapshot_interval=INTERVAL) as store:
        # HCA closes 3 windows, CSA 6; both leave tokens buffered. The turn (40 tokens) restores the snapshot
        # at the first answer's end, its repeat the snapshot before the prompt's last token.
        second_turn_and_repeat(model, store, random_prompt(27, seed=1), random_prompt(9, seed=2))


def test_a_divergence_restores_the_interval_snapshot_before_it() -> None:
    model = _tiny_deepseek_v4()
    with served(model, clean=False, snapshot_interval=INTERVAL) as store:
        # the last interval snapshot before the divergence at 33; the divergence is snapshotted on the way
        divergences(model, store, random_prompt(50, seed=3), [(33, random_prompt(12, seed=4), 30)])


def test_a_prompt_past_the_indexers_top_k_runs_cold_with_its_reason() -> None:
    """Past `index_topk` entries a query's selection may break ties by the call's shape: run cold, say why."""
    model = _tiny_deepseek_v4()
    store = PrefixCache(model, snapshot_interval=INTERVAL)
    try:
        hits = Hits(store)
        prompt = random_prompt(TOP_K * CSA_RATE + 1, seed=5)
        assert_same_as_cold(model, prompt, store, new=2)
        assert_same_as_cold(model, prompt, store, new=2)
        assert hits.last() == 0
        assert store.stats().fallbacks == {reasons.with_detail(reasons.INDEXER_TOP_K, TOP_K * CSA_RATE): 2}
    finally:
        store.detach()


@pytest.mark.parametrize("argument", sorted({CACHE_NAME, "past_key_values"}))
def test_the_store_is_taken_under_either_cache_argument(argument: str) -> None:
    model = _tiny_deepseek_v4()
    store = PrefixCache(model)
    try:
        hits = Hits(store)
        prompt = random_prompt(20, seed=6)
        assert_same_as_cold(model, prompt, store, new=3, cache_argument=argument)
        assert_same_as_cold(model, prompt, store, new=3, cache_argument=argument)
        assert hits.last() == prompt.shape[1] - 1
    finally:
        store.detach()


def test_snapshots_survive_the_disk_tier_and_a_new_store(tmp_path: Path) -> None:
    """Compressed states (empty buffers and unset overlap slices among them) written to disk restore exactly."""
    model = _tiny_deepseek_v4()
    prompt = random_prompt(30, seed=7)
    kwargs: dict[str, Any] = {"disk_dir": tmp_path, "snapshot_interval": INTERVAL, "save_on_exit": False}
    store = PrefixCache(model, max_bytes=1, **kwargs)  # nothing stays in memory
    try:
        assert_same_as_cold(model, prompt, store, new=3)
        assert store.stats().disk_nbytes > 0 and store.stats().device_nbytes == 0
    finally:
        store.detach()
    fresh = PrefixCache(model, **kwargs)
    try:
        hits = Hits(fresh)
        assert_same_as_cold(model, prompt, fresh, new=3)
        assert hits.last() == prompt.shape[1] - 1
        other = torch.cat([prompt[:, :15], random_prompt(8, seed=8)], 1)
        assert_same_as_cold(model, other, fresh, new=3)
        assert hits.last() == 12  # the interval snapshot before the divergence at 15
        assert fresh.stats().skipped_files == 0
    finally:
        fresh.detach()
