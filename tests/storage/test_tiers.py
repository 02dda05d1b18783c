"""Memory tiers: entries move device -> host -> dropped under budgets, come back exactly on a hit,
bytes are counted exactly on every tier, and an out-of-memory restore retries then runs cold."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import assert_same_as_cold, cached_model, distinct_prompt, generate, kv_bytes_per_token, random_prompt

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.hooks import pipeline
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.storage.tiers import DEVICE, HOST


def _tier_held_bytes(store: PrefixCache, tier: int) -> int:
    """Bytes of distinct tensor storages behind nodes of `tier`, plus their snapshots."""
    storages: dict[int, int] = {}
    snaps = 0
    for node in store._store._tree.iter_nodes():
        if node.tier != tier:
            continue
        seg = node.value
        snaps += sum(s.nbytes for s in seg.snapshots.values())
        if seg.run is not None:
            for t in seg.run.keys + seg.run.values:
                if t is not None:
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values()) + snaps


@pytest.fixture
def llama() -> Any:
    return cached_model("llama")


def test_over_device_budget_entries_move_to_host_and_hit_exactly(llama: Any) -> None:
    """Past the device budget old entries go to the host tier, stay within both budgets and still hit exactly."""
    per_token = kv_bytes_per_token(llama)
    store = PrefixCache(llama, max_device_bytes=80 * per_token, max_host_bytes=200 * per_token)
    try:
        prompts = [distinct_prompt(seed) for seed in range(5)]
        for p in prompts:
            generate(llama, p, past_key_values=store)
            stats = store.stats()
            assert stats.device_nbytes <= 80 * per_token and stats.host_nbytes <= 200 * per_token
            assert stats.device_nbytes == _tier_held_bytes(store, DEVICE)
            assert stats.host_nbytes == _tier_held_bytes(store, HOST)
            store.check_integrity()
        stats = store.stats()
        assert stats.offloads >= 3 and stats.host_nbytes > 0 and stats.evictions == 0
        first = prompts[0]
        assert store._store._tree.match(store._store.namespace(), first[0].tolist()).path[-1].tier == HOST
        before = store.stats().hit_tokens
        assert_same_as_cold(llama, first, store)
        assert store.stats().hit_tokens - before == first.shape[1] - 1
        assert store.stats().reloads >= 1
        assert store._store._tree.match(store._store.namespace(), first[0].tolist()).path[-1].tier == DEVICE
        store.check_integrity()
    finally:
        store.detach()


def test_entries_are_dropped_only_when_every_tier_is_full(llama: Any) -> None:
    """With both tiers full the least recently used entries are dropped; bytes never pass a budget."""
    per_token = kv_bytes_per_token(llama)
    store = PrefixCache(llama, max_device_bytes=40 * per_token, max_host_bytes=80 * per_token)
    try:
        for seed in range(8):
            generate(llama, distinct_prompt(seed), past_key_values=store)
            stats = store.stats()
            assert stats.device_nbytes <= 40 * per_token and stats.host_nbytes <= 80 * per_token
            store.check_integrity()
        stats = store.stats()
        assert stats.evictions > 0 and stats.entries == 3  # one 35-token entry on the device, two on the host
        with store.lookup(distinct_prompt(0)) as hit:
            assert hit.cached_len == 0  # the oldest is gone
        with store.lookup(distinct_prompt(6)) as hit:
            assert hit.cached_len == 29  # a recent one was kept (on the host) and restores
    finally:
        store.detach()


def test_shared_prefix_stays_on_the_device_while_its_branches_move(llama: Any) -> None:
    """A system prompt shared by many conversations is not offloaded before the branches that hang off it."""
    per_token = kv_bytes_per_token(llama)
    store = PrefixCache(llama, max_device_bytes=60 * per_token, max_host_bytes=400 * per_token)
    try:
        system = random_prompt(24, seed=3)
        for seed in range(6):
            question = random_prompt(10, seed=40 + seed)
            question[0, 0] = 5 + seed
            generate(llama, torch.cat([system, question], 1), past_key_values=store)
            store.check_integrity()
        node = store._store._tree.match(store._store.namespace(), system[0].tolist()).path[0]
        assert node.end == 24 and node.tier == DEVICE
        assert store.stats().host_nbytes > 0
    finally:
        store.detach()


def test_hybrid_model_snapshots_move_to_host_and_restore_exactly() -> None:
    """Recurrent snapshots travel with their entry to the host tier and restore exactly from there."""
    model = cached_model("bamba")  # keeps interval snapshots in a cold scan
    store = PrefixCache(model, max_device_bytes=1, max_host_bytes="64MB", snapshot_interval=8)
    try:
        ids = random_prompt(40, seed=11)
        generate(model, ids, past_key_values=store)
        stats = store.stats()
        assert stats.device_nbytes == 0 and stats.host_nbytes > 0 and stats.snapshots >= 5
        assert stats.host_nbytes == _tier_held_bytes(store, HOST)
        longer = torch.cat([ids, random_prompt(6, seed=12)], 1)
        before = store.stats().hit_tokens
        assert_same_as_cold(model, longer, store)
        assert store.stats().hit_tokens - before == 39  # the snapshot taken after prompt token 39
        # No room on the device: the hit was served from a copy and the new branch joined its parent's tier.
        assert store.stats().device_nbytes == 0
        assert all(n.tier >= n.parent.tier for n in store._store._tree.iter_nodes() if not n.parent.is_root)
        store.check_integrity()
    finally:
        store.detach()


def test_out_of_memory_on_restore_relieves_the_device_then_retries(llama: Any, monkeypatch: Any) -> None:
    """A first out-of-memory error while restoring moves entries off the device and the retry serves the hit."""
    store = PrefixCache(llama, max_host_bytes="64MB")
    try:
        ids = random_prompt(30, seed=21)
        generate(llama, ids, past_key_values=store)
        original = WorkingCache.restore
        calls = {"n": 0}

        def restore_failing_once(self: WorkingCache, *args: Any, **kwargs: Any) -> Any:
            calls["n"] += 1
            if calls["n"] == 1:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            return original(self, *args, **kwargs)

        monkeypatch.setattr(WorkingCache, "restore", restore_failing_once)
        before = store.stats().hit_tokens
        assert_same_as_cold(llama, ids, store)
        assert calls["n"] == 2
        assert store.stats().hit_tokens - before == 29
        assert store.stats().offloads >= 1  # the relief moved the entry to the host, the retry brought it back
        assert store.stats().fallbacks == {}
        store.check_integrity()
    finally:
        store.detach()


def test_out_of_memory_twice_runs_cold_with_a_reason(llama: Any, monkeypatch: Any) -> None:
    """Two out-of-memory errors in a row give a cold run, counted as `out_of_memory`, and nothing stays pinned."""
    store = PrefixCache(llama, max_host_bytes="64MB")
    try:
        ids = random_prompt(30, seed=22)
        generate(llama, ids, past_key_values=store)

        def failing_cache(profile: Any) -> Any:  # the hook's working caches (`pipeline.restore` makes them)
            cache = WorkingCache(profile)

            def restore(*args: Any, **kwargs: Any) -> None:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")

            cache.restore = restore  # type: ignore[method-assign]
            return cache

        monkeypatch.setattr(pipeline, "WorkingCache", failing_cache)
        assert_same_as_cold(llama, ids, store)
        assert store.stats().fallbacks == {"out_of_memory": 1}
        assert all(node.lock_ref == 0 for node in store._store._tree.iter_nodes())
        monkeypatch.undo()
        with store.lookup(ids) as hit:  # the entry survived both failures
            assert hit.cached_len == 29
        store.check_integrity()
    finally:
        store.detach()


def test_budgets_are_parsed_and_checked(llama: Any) -> None:
    """Tier budgets take strings, and contradictory settings say what to change."""
    store = PrefixCache(llama, max_device_bytes="1MB", max_host_bytes="2MiB", attach=False)
    assert store.budgets == {"device": 1_000_000, "host": 2 << 20, "disk": 0}
    with pytest.raises(ValueError, match="not both"):
        PrefixCache(llama, max_bytes=1, max_device_bytes=1, attach=False)
    with pytest.raises(ValueError, match="disk_dir"):
        PrefixCache(llama, max_disk_bytes="1GB", attach=False)
    with pytest.raises(ValueError, match="eviction policy"):
        PrefixCache(llama, policy="fifo", attach=False)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_offload_uses_pinned_memory_and_restores_exactly() -> None:
    """On CUDA the host tier is page-locked, copies run on a side stream, and hits restore exactly on the GPU."""
    model = cached_model("llama").to("cuda")
    per_token = kv_bytes_per_token(model)
    store = PrefixCache(model, max_device_bytes=40 * per_token, max_host_bytes="64MB")
    try:
        prompts = [distinct_prompt(seed).cuda() for seed in range(4)]
        for p in prompts:
            generate(model, p, past_key_values=store)
        host_nodes = [n for n in store._store._tree.iter_nodes() if n.tier == HOST]
        assert host_nodes
        for node in host_nodes:
            for t in node.value.run.keys:
                if t is not None:
                    assert t.is_pinned() and t.device.type == "cpu"
        assert_same_as_cold(model, prompts[0], store)
        node = store._store._tree.match(store._store.namespace(), prompts[0][0].tolist()).path[-1]
        assert node.tier == DEVICE and node.value.run.keys[0].device.type == "cuda"
        store.check_integrity()
    finally:
        store.detach()
        model.to("cpu")


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_device_map_restores_each_layer_to_its_own_device(tmp_path: Any) -> None:
    """With layers split over two GPUs, entries back from host and disk land on each layer's own device."""
    from accelerate import dispatch_model

    from hf_prefix_cache.testing.tiny_models import build

    model = build("llama")  # a copy of its own: dispatching moves its weights
    device_map = {
        "model.embed_tokens": 0,
        "model.rotary_emb": 0,
        "model.layers.0": 0,
        "model.layers.1": 1,
        "model.norm": 1,
        "lm_head": 1,
    }
    model = dispatch_model(model, device_map=device_map)
    per_token = kv_bytes_per_token(model)
    store = PrefixCache(model, max_device_bytes=40 * per_token, max_host_bytes=60 * per_token, disk_dir=tmp_path)
    try:
        prompts = [distinct_prompt(seed).to("cuda:0") for seed in range(5)]
        for p in prompts:
            generate(model, p, past_key_values=store)
        assert store.stats().disk_nbytes > 0
        for p in prompts[:2]:
            assert_same_as_cold(model, p, store)
            node = store._store._tree.match(store._store.namespace(), p[0].tolist()).path[-1]
            assert node.tier == DEVICE
            assert [k.device.index for k in node.value.run.keys] == [0, 1]
        store.check_integrity()
    finally:
        store.detach()


def test_a_branch_never_sits_on_a_faster_tier_than_its_parent(llama: Any) -> None:
    """When the device cannot take back an offloaded prefix, a new branch joins the prefix's tier."""
    per_token = kv_bytes_per_token(llama)
    store = PrefixCache(llama, max_device_bytes=20 * per_token, max_host_bytes=400 * per_token)
    try:
        ids = distinct_prompt(1)
        generate(llama, ids, past_key_values=store)  # 35 tokens: too big for the device, kept on the host
        assert store.stats().device_nbytes == 0 and store.stats().host_nbytes == 35 * per_token
        branch = torch.cat([ids, random_prompt(10, seed=2)], 1)
        before = store.stats().hit_tokens
        assert_same_as_cold(llama, branch, store)  # served from a temporary copy of the 30-token prefix
        assert store.stats().hit_tokens - before == 30
        assert all(n.tier >= n.parent.tier for n in store._store._tree.iter_nodes() if not n.parent.is_root)
        assert store.stats().device_nbytes == 0
        store.check_integrity()
    finally:
        store.detach()


def test_a_pooled_host_tier_passes_the_integrity_check_and_hits_exactly(llama: Any) -> None:
    """With host buffers from a reusing pool (as on CUDA), entries keep their size class and hit exactly.

    Regression: on a GPU `check_integrity` read a pooled buffer's size class as extra bytes held.
    """
    per_token = kv_bytes_per_token(llama)
    store = PrefixCache(llama, max_device_bytes=40 * per_token, max_host_bytes=200 * per_token)
    mover = store._store._placement.mover
    mover.pool.reuse = True  # what a model on CUDA gets (page-locked buffers are pooled)
    try:
        prompts = [distinct_prompt(seed, n=35) for seed in range(4)]
        for p in prompts:
            generate(llama, p, past_key_values=store)
            store.check_integrity()
        host = [n for n in store._store._tree.iter_nodes() if n.tier == HOST]
        assert host and all(mover.pool.owns(n.value.run.keys[0]) for n in host)
        held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for n in host for t in n.value.run.keys}
        assert sum(held.values()) > store.stats().host_nbytes  # the size classes round up what is counted
        assert_same_as_cold(llama, prompts[0], store)
        store.check_integrity()
        run = next(n.value.run for n in store._store._tree.iter_nodes() if n.tier == HOST)
        run.keys[0] = torch.cat([run.keys[0], run.keys[0]], -2)[..., : run.keys[0].shape[-2], :]  # a view of more
        with pytest.raises(RuntimeError, match="keeps"):
            store.check_integrity()
    finally:
        store.detach()
