"""`prompt_snapshot=False`: a recurrent model's hit feeds its whole suffix in generate's forward, still exactly."""

from __future__ import annotations

import pytest
import torch
from conftest import Hits, assert_same_as_cold, cached_model, distinct_prompt

from hf_prefix_cache import PrefixCache

MODELS = ("bamba", "jamba", "qwen3_next", "lfm2", "mamba2", "mamba")


@pytest.mark.parametrize("name", MODELS)
def test_a_chat_without_prompt_snapshots_is_exact_and_reuses_answer_ends(name: str) -> None:
    """Each turn restores the previous answer-end snapshot and matches a cold run, with no split prefill."""
    model = cached_model(name)
    store = PrefixCache(model, prompt_snapshot=False, snapshot_interval=None)
    hits = Hits(store)
    ids = distinct_prompt(7)
    stored_len = 0  # the previous answer's end: its sequence less the last token (never fed)
    try:
        for turn in range(3):
            out = assert_same_as_cold(model, ids, store, new=4)
            assert hits.last() == stored_len, f"turn {turn} should restore the previous answer end"
            stored_len = out.sequences.shape[1] - 1
            ids = torch.cat([out.sequences, distinct_prompt(20 + turn, 6)], dim=1)
        store.check_integrity()
    finally:
        store.detach()


def test_without_prompt_snapshots_a_repeat_reuses_less() -> None:
    """Without the prompt-end snapshot the same prompt again reuses only up to its last interval snapshot."""
    model = cached_model("bamba")
    ids = distinct_prompt(8, 40)
    reused = {}
    for setting in (True, False):
        store = PrefixCache(model, prompt_snapshot=setting, snapshot_interval=16)
        hits = Hits(store)
        assert_same_as_cold(model, ids, store, new=1)
        assert_same_as_cold(model, ids, store, new=1)
        reused[setting] = hits.last()
        store.detach()
    assert reused[True] == ids.shape[1] - 1
    assert reused[False] == 32  # the last interval snapshot
