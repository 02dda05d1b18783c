"""What the store logs: INFO for what a user wants to know, DEBUG for the rest, WARNING only for problems."""

from __future__ import annotations

import logging

import pytest
from conftest import build, distinct_prompt, generate

from hf_prefix_cache import PrefixCache


def _messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and r.name == "hf_prefix_cache"]


def test_normal_use_logs_reuse_and_storage_at_info_and_details_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    """Two requests log what they reused and stored at INFO, details at DEBUG, and nothing at WARNING."""
    model = build("llama")
    store = PrefixCache(model, max_bytes=20_000)
    ids = distinct_prompt(1)
    try:
        with caplog.at_level(logging.DEBUG, logger="hf_prefix_cache"):
            generate(model, ids, past_key_values=store)
            generate(model, ids, past_key_values=store)
            generate(model, distinct_prompt(2), past_key_values=store)  # over the budget: the first entry moves
        info = _messages(caplog, logging.INFO)
        assert f"prefix cache: reused 0 of {ids.shape[1]} prompt tokens" in info
        assert f"prefix cache: reused {ids.shape[1] - 1} of {ids.shape[1]} prompt tokens" in info
        assert any(m.startswith("prefix cache: stored") for m in info)
        assert _messages(caplog, logging.DEBUG)
        assert not _messages(caplog, logging.WARNING)
    finally:
        store.detach()


def test_a_weights_change_and_a_cold_reason_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    """A weights change is an INFO line; a cold reason is a WARNING the first time and DEBUG after."""
    model = build("llama")
    store = PrefixCache(model)
    ids = distinct_prompt(1)
    try:
        with caplog.at_level(logging.DEBUG, logger="hf_prefix_cache"):
            generate(model, ids, past_key_values=store)
            model.lm_head.weight.data.mul_(2)
            generate(model, ids, past_key_values=store)
            for _ in range(2):
                generate(model, ids, past_key_values=store, output_hidden_states=True)
        assert any("weights, dtype or adapters changed" in m for m in _messages(caplog, logging.INFO))
        assert _messages(caplog, logging.WARNING) == ["prefix cache skipped, running cold: output_hidden_states"]
        assert "prefix cache skipped, running cold: output_hidden_states" in _messages(caplog, logging.DEBUG)
    finally:
        store.detach()
