"""The store's contract with the hooks (store/contract.py): a frozen lease, released once, and an insert outcome."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.keys.prefix_key import PrefixKey
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.store.contract import InsertOutcome, Store
from hf_prefix_cache.testing.tiny_models import build


def test_a_prefix_cache_holds_a_store() -> None:
    store = PrefixCache(build("llama"), attach=False)
    assert isinstance(store._store, Store)
    assert not isinstance(store, Store)  # the user's object: its verbs only
    assert not isinstance(torch.zeros(1), Store)


def test_lease_is_frozen_and_released_in_one_place() -> None:
    store = PrefixCache(build("llama"), attach=False)
    ids = list(range(4, 30))
    cache = store._store.new_cache()
    assert store._store.insert_sequence(PrefixKey(store._store.namespace(), ids), _filled(store, ids)) == InsertOutcome(
        len(ids)
    )
    lease = store._store.acquire(PrefixKey(store._store.namespace(), ids + [99]), cache)
    assert (lease.cached_len, lease.matched_len, lease.num_items) == (len(ids), len(ids), 0)
    assert cache.get_seq_length() == len(ids)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lease.cached_len = 0  # type: ignore[misc]
    assert all(n.lock_ref == 1 for n in store._store._tree.iter_nodes())
    store._store.release(lease)
    store._store.release(lease)  # a second release changes nothing
    assert all(n.lock_ref == 0 for n in store._store._tree.iter_nodes())
    store.check_integrity()


def test_insert_outcome_names_why_nothing_was_stored() -> None:
    store = PrefixCache(build("llama"), attach=False, min_store_len=10)
    ids = list(range(4, 9))
    outcome = store._store.insert_sequence(PrefixKey(store._store.namespace(), ids), _filled(store, ids))
    assert outcome == InsertOutcome(0, skipped="entry_below_min_store_len")
    assert store.stats().fallbacks == {"entry_below_min_store_len": 1}


def test_acquire_that_fails_leaves_nothing_pinned() -> None:
    store = PrefixCache(build("llama"), attach=False)
    ids = list(range(4, 30))
    store._store.insert_sequence(PrefixKey(store._store.namespace(), ids), _filled(store, ids))
    cache = store._store.new_cache()

    def failing_restore(*args: object, **kwargs: object) -> None:
        raise RuntimeError("restore failed (injected)")

    cache.restore = failing_restore  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="injected"):
        store._store.acquire(PrefixKey(store._store.namespace(), ids + [99]), cache)
    assert all(n.lock_ref == 0 for n in store._store._tree.iter_nodes())


def _filled(store: PrefixCache, ids: list[int]) -> WorkingCache:
    """A working cache holding the model's states of `ids`."""
    cache = store._store.new_cache()
    with torch.no_grad():
        store.model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return cache


def test_the_hooks_contract_has_nine_members() -> None:
    """A hook sees nine members of a store: its model, the namespace, three reads and the four request verbs."""
    members = {name for name in dir(Store) if not name.startswith("_")} | set(Store.__annotations__)
    reads = {"has_entries", "stored_len", "next_symbols"}
    verbs = {"acquire", "release", "insert_sequence", "record"}
    assert members == {"model", "namespace"} | reads | verbs
