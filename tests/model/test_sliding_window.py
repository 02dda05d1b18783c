"""Sliding-window layers stored as windows (`sliding_window_mode="window"`): exact at every restore point,
about the model's own cache in bytes, and persistent on disk."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Hits, assert_same_as_cold, cached_model, random_prompt
from transformers import DynamicCache

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.tiny_build import WINDOW
from hf_prefix_cache.testing.tiny_models import SLIDING


def _window_store(model: Any, **kwargs: Any) -> PrefixCache:
    return PrefixCache(model, sliding_window_mode="window", **kwargs)


@pytest.mark.parametrize("name", SLIDING)
def test_windowed_layers_restore_exactly_at_prompt_answer_and_divergence_points(name: str) -> None:
    """Repeats, chat turns and divergences equal cold runs and reuse up to the snapshot they need."""
    model = cached_model(name)
    store = _window_store(model)
    try:
        hits = Hits(store)
        prompt = random_prompt(40, seed=71)
        out = assert_same_as_cold(model, prompt, store)
        assert hits.last() == 0
        assert_same_as_cold(model, prompt, store)
        assert hits.last() == 39  # the snapshot before the last prompt token
        turn = torch.cat([out.sequences, random_prompt(10, seed=72)], 1)
        assert_same_as_cold(model, turn, store)
        assert hits.last() == out.sequences.shape[1] - 1  # the whole previous turn
        diverging = torch.cat([prompt[:, :25], random_prompt(15, seed=73)], 1)
        assert_same_as_cold(model, diverging, store)
        assert hits.last() == 0  # no window was kept at 25 (no interval snapshots)
        again = torch.cat([prompt[:, :25], random_prompt(15, seed=74)], 1)
        again[0, 25] = 99 if again[0, 25] != 99 else 98
        assert_same_as_cold(model, again, store)
        assert hits.last() == 25  # the divergence snapshot of the previous request
        store.check_integrity()
    finally:
        store.detach()


def _own_cache_nbytes(model: Any, ids: torch.Tensor) -> int:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def test_a_windowed_entry_costs_about_the_models_own_cache() -> None:
    """A long prompt stored with windows costs its full-attention keys plus one window per snapshot."""
    model = cached_model("gemma3_text")
    ids = random_prompt(120, seed=75)
    stores = {mode: PrefixCache(model, sliding_window_mode=mode) for mode in ("every_position", "window")}
    try:
        for store in stores.values():
            assert_same_as_cold(model, ids, store, new=2)
        c = model.config
        per_position = 2 * c.num_key_value_heads * c.head_dim * 4  # keys and values of one layer, float32
        num_sliding = sum(t == "sliding_attention" for t in c.layer_types)
        num_full = c.num_hidden_layers - num_sliding
        stored_len = 121  # the prompt and the first answer token (the last one is never fed)
        # Windows at 119 (before the last prompt token) and 121 (the answer's end) touch: held once,
        # as one window reaching two positions further back.
        window = stores["window"].stats().nbytes
        assert window == (num_full * stored_len + num_sliding * (WINDOW - 1 + 2)) * per_position
        assert _own_cache_nbytes(model, ids[:, :1].repeat(1, stored_len)) * 1.2 >= window
        assert stores["every_position"].stats().nbytes == c.num_hidden_layers * stored_len * per_position
    finally:
        for store in stores.values():
            store.detach()


def test_windowed_entries_persist_on_disk(tmp_path: Path) -> None:
    """A new store reading the same disk_dir restores a windowed entry at its full length, exactly."""
    model = cached_model("gemma2")
    ids = random_prompt(40, seed=76)
    store = _window_store(model, disk_dir=tmp_path, save_on_exit=False)
    try:
        out = assert_same_as_cold(model, ids, store)
        store.save()
    finally:
        store.detach()
    fresh = _window_store(model, disk_dir=tmp_path, save_on_exit=False)
    try:
        hits = Hits(fresh)
        assert_same_as_cold(model, ids, fresh)
        assert hits.last() == 39  # the answer-end window reaches back to the prompt end
        assert_same_as_cold(model, torch.cat([out.sequences, random_prompt(5, seed=77)], 1), fresh)
        assert hits.last() == out.sequences.shape[1] - 1
        fresh.check_integrity()
    finally:
        fresh.detach()


def test_windows_far_apart_are_kept_apart() -> None:
    """A long answer leaves the prompt-end and answer-end windows apart: two windows, both restorable."""
    model = cached_model("mistral")
    store = _window_store(model)
    try:
        hits = Hits(store)
        ids = random_prompt(30, seed=78)
        out = assert_same_as_cold(model, ids, store, new=WINDOW + 4)
        assert sorted(
            (s.length, s.reach) for n in store._store._tree.iter_nodes() for s in n.value.snapshots.values()
        ) == [
            (29, 0),
            (30 + WINDOW + 3, 0),
        ]
        assert_same_as_cold(model, ids, store)
        assert hits.last() == 29
        assert_same_as_cold(model, torch.cat([out.sequences, random_prompt(5, seed=79)], 1), store)
        assert hits.last() == out.sequences.shape[1] - 1
    finally:
        store.detach()


def test_an_unknown_sliding_window_mode_is_refused() -> None:
    """A misspelt mode names the accepted ones."""
    with pytest.raises(ValueError, match="every_position, window"):
        PrefixCache(cached_model("mistral"), sliding_window_mode="windowed")
