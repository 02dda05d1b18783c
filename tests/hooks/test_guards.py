"""Exactness guards: a stored or captured state that disagrees with its sequence never reaches an answer or the store.

Each test breaks one state on purpose and checks the request still equals a cold run (it ran cold), the
failure is counted under its reason in `stats().fallbacks`, and it is logged once at WARNING. The guards are
explicit raises (`errors.InconsistentStateError`), so these hold under ``python -O`` too
(`test_optimized.py` runs this file there).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import CACHE_NAME, assert_same_as_cold, cached_model, generate, random_prompt

from hf_prefix_cache import PrefixCache, reasons
from hf_prefix_cache.model.layers.full import FullAttentionAdapter

# Full attention, and sliding layers restored from their recorded past (the adapter with the 5.25 counter check).
MODELS = ["llama", "mistral"]


@pytest.fixture(params=MODELS)
def model(request: pytest.FixtureRequest) -> Any:
    return cached_model(request.param)


@pytest.fixture
def store(model: Any) -> Iterator[PrefixCache]:
    store = PrefixCache(model)
    yield store
    store.detach()


def _warnings(caplog: pytest.LogCaptureFixture, reason: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and r.name == "hf_prefix_cache" and reason in r.getMessage()
    ]


def _cut_stored_keys(store: PrefixCache, keep: int) -> None:
    """Keep only the first `keep` positions of every stored run's keys: a longer restore reads too few."""
    for node in store._store._tree.iter_nodes():
        run = node.value.run if node.value is not None else None
        if run is not None:
            run.keys = [k[..., :keep, :] if k is not None else None for k in run.keys]
            run._views = None  # views already cut from the whole keys


def test_a_stored_run_one_position_short_runs_the_call_cold_and_is_dropped(
    model: Any, store: PrefixCache, caplog: pytest.LogCaptureFixture
) -> None:
    """A restore whose stored keys hold fewer positions than planned runs cold (same tokens, counted, one WARNING),
    and the entry is dropped: the next request stores the prompt again and the one after reuses it."""
    prompt = random_prompt(24, seed=431)
    generate(model, prompt, **{CACHE_NAME: store})  # stored
    _cut_stored_keys(store, prompt.shape[1] - 2)  # a repeat restores all but the last prompt token: one short
    with caplog.at_level(logging.DEBUG, logger="hf_prefix_cache"):
        assert_same_as_cold(model, prompt, store)
    stats = store.stats()
    assert stats.fallbacks == {reasons.INCONSISTENT_RESTORE: 1}
    assert stats.hit_tokens == 0 and stats.entries == 0
    logged = _warnings(caplog, reasons.INCONSISTENT_RESTORE)
    assert len(logged) == 1 and "from keys of" in logged[0], logged
    assert_same_as_cold(model, prompt, store)  # a miss, stored
    assert_same_as_cold(model, prompt, store)  # a hit
    assert store.stats().hit_tokens == prompt.shape[1] - 1
    store.check_integrity()


def test_a_captured_layer_one_position_short_reruns_the_call_cold(
    model: Any, store: PrefixCache, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A finished request whose cache holds other positions than its sequence (as transformers 5.25's counters made
    hybrid layers do) is not trusted: nothing is stored, the call runs again cold, counted, logged once."""
    capture_kv = FullAttentionAdapter.capture_kv

    def one_short(self: FullAttentionAdapter, layer: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        kv = capture_kv(self, layer)
        return None if kv is None else (kv[0][..., :-1, :], kv[1][..., :-1, :])

    monkeypatch.setattr(FullAttentionAdapter, "capture_kv", one_short)
    prompt = random_prompt(24, seed=432)
    with caplog.at_level(logging.DEBUG, logger="hf_prefix_cache"):
        assert_same_as_cold(model, prompt, store)
        assert_same_as_cold(model, prompt, store)
    stats = store.stats()
    assert stats.fallbacks == {reasons.INCONSISTENT_CAPTURE: 2}
    assert stats.entries == 0 and stats.hit_tokens == 0 and stats.requests == 2
    logged = _warnings(caplog, reasons.INCONSISTENT_CAPTURE)
    assert len(logged) == 1 and "holds" in logged[0], logged
    monkeypatch.undo()
    assert_same_as_cold(model, prompt, store)  # the guard passes again: stored, and the repeat hits
    assert_same_as_cold(model, prompt, store)
    assert store.stats().hit_tokens == prompt.shape[1] - 1


def test_an_encoder_decoder_capture_one_position_short_reruns_the_call_cold(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Encoder-decoder calls take the one request path (`pipeline.serve`): a finished request whose decoder cache holds
    other positions than its sequence is not trusted, nothing is stored, the call runs again cold, counted, logged
    once."""
    from hooks.test_seq2seq import encoder_input, run, same_as_cold, tiny

    capture_kv = FullAttentionAdapter.capture_kv

    def one_short(self: FullAttentionAdapter, layer: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
        kv = capture_kv(self, layer)
        return None if kv is None else (kv[0][..., :-1, :], kv[1][..., :-1, :])

    model = tiny("bart")
    store = PrefixCache(model)
    try:
        monkeypatch.setattr(FullAttentionAdapter, "capture_kv", one_short)
        inputs = encoder_input("bart", seed=5)
        with caplog.at_level(logging.DEBUG, logger="hf_prefix_cache"):
            same_as_cold(model, store, inputs)
            same_as_cold(model, store, inputs)
        stats = store.stats()
        assert stats.fallbacks == {reasons.INCONSISTENT_CAPTURE: 2} and stats.entries == 0
        assert stats.hit_tokens == 0 and stats.requests == 2
        assert len(_warnings(caplog, reasons.INCONSISTENT_CAPTURE)) == 1
        monkeypatch.undo()
        run(model, inputs, past_key_values=store)
        assert store.stats().entries == 1
    finally:
        store.detach()
