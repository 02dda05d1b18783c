"""The store's memory behaviour: zero-copy restores, bytes held once and counted exactly, budgets,
LRU eviction, pinning, thread safety and the low-level lookup/insert API."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from conftest import assert_same_as_cold, cached_model, generate, kv_bytes_per_token, random_prompt

import hf_prefix_cache
from hf_prefix_cache import PrefixCache
from hf_prefix_cache.model.runs import Run
from hf_prefix_cache.storage.budgets import parse_nbytes


def _runs(store: PrefixCache) -> list[Run]:
    runs = {id(n.value.run): n.value.run for n in store._store._tree.iter_nodes() if n.value.run is not None}
    return list(runs.values())


def _held_bytes(store: PrefixCache) -> int:
    """Bytes of every distinct tensor storage the store keeps alive, plus snapshot bytes."""
    storages: dict[int, int] = {}
    for run in _runs(store):
        for t in run.keys + run.values:
            if t is not None:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    snaps = sum(s.nbytes for n in store._store._tree.iter_nodes() for s in n.value.snapshots.values())
    return sum(storages.values()) + snaps


@pytest.fixture
def llama() -> Any:
    return cached_model("llama")


def test_restore_shares_stored_tensors_without_copying(llama: Any) -> None:
    """A hit restores views of the stored keys, and generation never writes into them."""
    store = PrefixCache(llama)
    try:
        ids = random_prompt(40, seed=1)
        generate(llama, ids, past_key_values=store)
        (run,) = _runs(store)
        before = [t.clone() for t in run.keys]
        with store.lookup(ids) as hit:
            assert hit.cached_len == 39
            restored = hit.cache.layers[0].keys
            assert restored.untyped_storage().data_ptr() == run.keys[0].untyped_storage().data_ptr()
        generate(llama, ids, past_key_values=store)
        generate(llama, torch.cat([ids, random_prompt(5, seed=2)], 1), past_key_values=store)
        assert all(torch.equal(a, b[..., : a.shape[-2], :]) for a, b in zip(before, run.keys, strict=True))
    finally:
        store.detach()


def test_shared_prefix_is_stored_once_and_bytes_are_exact(llama: Any) -> None:
    """Conversations sharing a 30-token start hold those 30 tokens once; counted bytes equal held bytes."""
    store = PrefixCache(llama)
    try:
        common = random_prompt(30, seed=3)
        tails = []
        for seed in range(4):
            tail = random_prompt(10, seed=50 + seed)
            tail[0, 0] = 100 + seed
            tails.append(tail)
            generate(llama, torch.cat([common, tail], 1), new=6, past_key_values=store)
        stats = store.stats()
        # 30 shared + 4 x (10 prompt + 5 fed answer tokens) distinct positions
        assert stats.nbytes == (30 + 4 * 15) * kv_bytes_per_token(llama)
        assert stats.nbytes == _held_bytes(store)
        assert stats.entries == 4
        store.check_integrity()
    finally:
        store.detach()


def test_multi_turn_keeps_one_run_so_restores_stay_views(llama: Any) -> None:
    """Each chat turn moves the conversation onto its newest tensors: one run, no copies, exact bytes."""
    store = PrefixCache(llama)
    try:
        turn = random_prompt(30, seed=4)
        for i in range(4):
            out = generate(llama, turn, past_key_values=store)
            turn = torch.cat([out.sequences, random_prompt(6, seed=60 + i)], 1)
        assert len(_runs(store)) == 1
        assert store.stats().nbytes == _held_bytes(store)
        with store.lookup(turn) as hit:
            (run,) = _runs(store)
            assert hit.cache.layers[1].keys.untyped_storage().data_ptr() == run.keys[1].untyped_storage().data_ptr()
    finally:
        store.detach()


def test_budget_evicts_least_recently_used_and_compacts(llama: Any) -> None:
    """Under a small budget old conversations go first, bytes stay under it and match what is held."""
    per_token = kv_bytes_per_token(llama)
    store = PrefixCache(llama, max_bytes=120 * per_token)
    try:
        common = random_prompt(20, seed=5)
        prompts = []
        for seed in range(8):
            tail = random_prompt(15, seed=70 + seed)
            tail[0, 0] = 100 + seed
            prompts.append(torch.cat([common, tail], 1))
        favourite = prompts[0]
        for p in prompts:
            generate(llama, p, past_key_values=store)
            generate(llama, favourite, new=1, past_key_values=store)  # keep it recently used
            stats = store.stats()
            assert stats.nbytes <= store.max_bytes
            assert stats.nbytes == _held_bytes(store)
            store.check_integrity()
        assert store.stats().evictions > 0
        with store.lookup(favourite) as hit:
            assert hit.cached_len == favourite.shape[1] - 1
        with store.lookup(prompts[1]) as hit:
            assert hit.cached_len == 20  # its own tail was evicted, the shared start survives
    finally:
        store.detach()


def test_pinned_entries_survive_eviction(llama: Any) -> None:
    """While a lookup holds an entry, no amount of new entries evicts it."""
    per_token = kv_bytes_per_token(llama)
    store = PrefixCache(llama, max_bytes=100 * per_token)
    try:
        pinned_ids = random_prompt(40, seed=6)
        generate(llama, pinned_ids, past_key_values=store)
        with store.lookup(pinned_ids) as hit:
            for seed in range(6):
                generate(llama, random_prompt(40, seed=80 + seed), past_key_values=store)
            assert store.lookup(pinned_ids).cached_len == 39
            assert hit.cached_len == 39
        generate(llama, random_prompt(40, seed=99), past_key_values=store)
        store.check_integrity()
    finally:
        store.detach()


def test_entry_larger_than_the_budget_is_not_stored(llama: Any) -> None:
    """A sequence bigger than the whole budget is served but not stored, and nothing else is lost."""
    per_token = kv_bytes_per_token(llama)
    store = PrefixCache(llama, max_bytes=50 * per_token)
    try:
        small = random_prompt(20, seed=7)
        generate(llama, small, past_key_values=store)
        kept = store.stats().nbytes
        assert_same_as_cold(llama, random_prompt(80, seed=8), store)
        stats = store.stats()
        assert stats.fallbacks == {"entry_over_budget": 1}
        assert stats.nbytes == kept
    finally:
        store.detach()


def test_recurrent_snapshots_count_against_the_budget() -> None:
    """Hybrid-model snapshots are bytes like any other: the budget holds and counted bytes are exact."""
    model = cached_model("bamba")  # keeps interval snapshots in a cold scan
    store = PrefixCache(model, snapshot_interval=8)
    try:
        generate(model, random_prompt(40, seed=9), past_key_values=store)
        one = store.stats().nbytes
        assert store.stats().snapshots >= 5
        assert one == _held_bytes(store)
        store.max_bytes = int(one * 1.5)
        for seed in range(4):
            assert_same_as_cold(model, random_prompt(40, seed=90 + seed), store)
            assert store.stats().nbytes <= store.max_bytes
            assert store.stats().nbytes == _held_bytes(store)
        store.check_integrity()
    finally:
        store.detach()


def test_concurrent_generate_calls_are_correct(llama: Any) -> None:
    """Four threads generating through one store get the cold results and leave a consistent store."""
    store = PrefixCache(llama)
    system = random_prompt(30, seed=10)
    prompts = [torch.cat([system, random_prompt(8, seed=200 + i)], 1) for i in range(8)]
    expected = [generate(llama, p).sequences for p in prompts]
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for k in range(6):
                i = (offset + k) % len(prompts)
                out = generate(llama, prompts[i], past_key_values=store)
                assert torch.equal(out.sequences, expected[i])
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread
            errors.append(exc)

    try:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        stats = store.stats()
        assert stats.requests == 24 and stats.hit_tokens >= 16 * 30
        store.check_integrity()
        assert all(n.lock_ref == 0 for n in store._store._tree.iter_nodes())
    finally:
        store.detach()


def test_low_level_lookup_and_insert_match_a_cold_forward(llama: Any) -> None:
    """A hand-written forward loop with lookup/insert gives the cold logits and feeds only the suffix."""
    store = PrefixCache(llama, attach=False)
    ids = random_prompt(40, seed=11)
    with torch.no_grad():
        cold = llama(ids).logits[:, -1]
        first = store._store.new_cache()
        llama(ids, past_key_values=first, use_cache=True)
        assert store.insert(ids, first) == 40
        longer = torch.cat([ids, random_prompt(8, seed=12)], 1)
        with store.lookup(longer) as hit:
            assert hit.cached_len == 40
            out = llama(longer[:, hit.cached_len :], past_key_values=hit.cache, use_cache=True)
        full = llama(longer).logits[:, -1]
        assert (out.logits[:, -1] - full).abs().max() < 1e-4
        assert store.insert(longer, hit.cache) == 8
        with pytest.raises(ValueError, match="holds 48 positions but 40"):
            store.insert(ids, hit.cache)
        assert (cold - llama(ids).logits[:, -1]).abs().max() == 0
    store.check_integrity()


def test_dtype_change_never_reuses_other_dtype_states() -> None:
    """After model.double() the float32 entries are in another namespace: no hit, exact output."""
    model = cached_model("qwen3").__class__(cached_model("qwen3").config).eval()
    model.load_state_dict(cached_model("qwen3").state_dict())
    model.generation_config.eos_token_id = None
    store = PrefixCache(model)
    try:
        ids = random_prompt(30, seed=13)
        generate(model, ids, past_key_values=store)
        model.double()
        assert_same_as_cold(model, ids, store)
        assert store.stats().hit_tokens == 0
        assert_same_as_cold(model, ids, store)
        assert store.stats().hit_tokens == 29
    finally:
        store.detach()


def test_salted_stores_do_not_share_entries(llama: Any) -> None:
    """Two tenants' stores on one model never see each other's prefixes."""
    alice, bob = PrefixCache(llama, salt="alice"), PrefixCache(llama, salt="bob")
    try:
        ids = random_prompt(30, seed=14)
        generate(llama, ids, past_key_values=alice)
        assert_same_as_cold(llama, ids, bob)
        assert bob.stats().hit_tokens == 0 and alice._store.namespace() != bob._store.namespace()
    finally:
        bob.detach()
        alice.detach()


@pytest.mark.parametrize(
    ("text", "expected"),
    [(4096, 4096), ("512MB", 512_000_000), ("1.5 GiB", 1536 << 20), ("2gb", 2_000_000_000), ("10", 10)],
)
def test_byte_sizes_are_parsed(text: int | str, expected: int) -> None:
    """Budgets accept ints and strings with decimal or binary units."""
    assert parse_nbytes(text) == expected


@pytest.mark.parametrize("bad", ["12 parsecs", "-5", -5, "GB"])
def test_bad_byte_sizes_say_what_to_write(bad: int | str) -> None:
    """An unreadable budget raises a ValueError that shows the accepted forms."""
    with pytest.raises(ValueError, match="byte size"):
        parse_nbytes(bad)


def test_public_names_are_sorted_and_importable() -> None:
    """`__all__` is sorted and every name in it exists."""
    assert hf_prefix_cache.__all__ == sorted(hf_prefix_cache.__all__)
    assert all(hasattr(hf_prefix_cache, name) for name in hf_prefix_cache.__all__)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_batch_rows_reuse_their_shared_stored_prefix(name: str) -> None:
    """Unpadded rows sharing a stored system prompt reuse it, match a cold batch, and are stored row by row."""
    model = cached_model(name)
    store = PrefixCache(model)
    try:
        system = random_prompt(30, seed=15)
        generate(model, torch.cat([system, random_prompt(8, seed=300)], 1), past_key_values=store)
        questions = []
        for i in range(3):
            q = random_prompt(8, seed=301 + i)
            q[0, 0] = 100 + i
            questions.append(torch.cat([system, q], 1))
        batch = torch.cat(questions)
        hits = store.stats().hit_tokens
        warm = assert_same_as_cold(model, batch, store)
        assert store.stats().hit_tokens - hits == 3 * 30
        store.check_integrity()
        assert store.stats().nbytes == _held_bytes(store)
        for row in range(3):
            with store.lookup(warm.sequences[row : row + 1]) as hit:
                assert hit.cached_len == warm.sequences.shape[1] - 1
    finally:
        store.detach()


def test_identical_rows_reuse_all_but_the_last_token(llama: Any) -> None:
    """A batch of one prompt repeated reuses everything but the last token for every row."""
    store = PrefixCache(llama)
    try:
        ids = random_prompt(30, seed=16)
        generate(llama, ids, past_key_values=store)
        hits = store.stats().hit_tokens
        assert_same_as_cold(llama, torch.cat([ids, ids]), store)
        assert store.stats().hit_tokens - hits == 2 * 29
    finally:
        store.detach()


def test_a_branch_after_a_shared_prefix_keeps_only_its_new_positions_in_one_buffer(llama: Any) -> None:
    """Two questions after one stored prefix: each branch holds its own positions packed in one buffer, counted exactly."""
    per_token = kv_bytes_per_token(llama)
    store = PrefixCache(llama)
    try:
        prefix = random_prompt(40, seed=11)
        generate(llama, prefix, past_key_values=store)
        for seed in (12, 13):
            ids = torch.cat([prefix, random_prompt(6, seed=seed)], 1)
            assert_same_as_cold(llama, ids, store)
            store.check_integrity()
        (shared,) = [n for n in store._store._tree.iter_nodes() if n.start == 0]
        branches = [n for n in store._store._tree.iter_nodes() if n.value.run is not shared.value.run]
        assert len(branches) == 2
        for leaf in branches:
            tensors = [t for t in leaf.value.run.keys + leaf.value.run.values if t is not None]
            assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1  # one packed copy
            assert tensors[0].untyped_storage().nbytes() == (leaf.end - leaf.start) * per_token
        assert store.stats().device_nbytes == _held_bytes(store)
    finally:
        store.detach()
