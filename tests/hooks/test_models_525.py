"""Model types new in transformers 5.25 are served exactly, or cold with a counted reason.

Every request runs cold and through the store: equal tokens, logits within 1e-4; hits are counted.
Kolibri 1.1's "reuse" layers attend to an earlier layer's keys and never write their own cache
layer (a `DummyLayer`): they are neither captured nor restored. Its indexed layers keep no indexer
keys, so they are stored as full attention, and prompts are served up to the indexers' budget (a
query seeing at most top-k + local + sink keys keeps them all). Ovis2.5's items span their framing
ids (embedded as media only in a call passing their pixels): a changed image reuses nothing from its
start id on. Both VLMs' image and video turns run in `tests/media/test_media_families.py`.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from conftest import Hits, assert_same_as_cold, random_prompt

from hf_prefix_cache import reasons
from hf_prefix_cache.model.profile import profile_model
from hf_prefix_cache.testing import tiny_525
from hf_prefix_cache.testing.compare import served
from hf_prefix_cache.testing.tiny_525 import KOLIBRI_LAYERS, KOLIBRI_LOCAL, KOLIBRI_SINK, KOLIBRI_TOP_K

pytest.importorskip("transformers.models.kolibri1_1", reason="model types new in transformers 5.25")

BUDGET = KOLIBRI_TOP_K + KOLIBRI_LOCAL + KOLIBRI_SINK


@functools.cache
def _model(name: str) -> Any:
    return getattr(tiny_525, f"tiny_{name}")()


def _turns(model: Any, store: Any, first: int, more: int, new: int = 4) -> None:
    """A first prompt, a second turn (its answer + `more` ids) reusing all but the answer's last token, a repeat."""
    hits = Hits(store)
    out = assert_same_as_cold(model, random_prompt(first, seed=1), store, new=new)
    assert hits.last() == 0
    turn = torch.cat([out.sequences, random_prompt(more, seed=2)], 1)
    assert_same_as_cold(model, turn, store, new=new)
    assert hits.last() == out.sequences.shape[1] - 1
    assert_same_as_cold(model, turn, store, new=new)
    assert hits.last() == turn.shape[1] - 1


@pytest.mark.parametrize("name", ["ergo", "minicpm5_moe", "param2moe", "kolibri1_1"])
def test_a_second_turn_and_its_repeat_reuse_the_first_exactly(name: str) -> None:
    model = _model(name)
    with served(model) as store:
        _turns(model, store, first=7, more=3)  # Kolibri: 7 + 4 + 3 = 14 ids, within the indexers' budget (18)


def test_kolibri_reuse_layers_hold_nothing_and_indexed_layers_hold_keys() -> None:
    profile = profile_model(_model("kolibri1_1"))
    sources = _model("kolibri1_1").config.kv_source_layers
    reuse = [i for i, source in enumerate(sources) if source != i]
    assert profile.unsupported is None and reuse == [2]
    assert profile.kv_layers == tuple(i for i in range(len(KOLIBRI_LAYERS)) if i not in reuse)
    assert profile.exact_prompt_len == BUDGET and not profile.watch_indexers


def test_kolibri_decodes_past_the_indexers_budget_exactly() -> None:
    """Queries past the budget select keys (pooled top-k, sink, local) in both runs: a hit decoding past it agrees."""
    model = _model("kolibri1_1")
    with served(model) as store:
        hits = Hits(store)
        out = assert_same_as_cold(model, random_prompt(8, seed=1), store, new=4)
        turn = torch.cat([out.sequences, random_prompt(3, seed=2)], 1)  # 15 ids, decoding to 15 + BUDGET
        assert_same_as_cold(model, turn, store, new=BUDGET)
        assert hits.last() == out.sequences.shape[1] - 1


def test_kolibri_beams_and_a_padded_batch_reuse_the_stored_prompt_exactly() -> None:
    model = _model("kolibri1_1")
    prompt, other = random_prompt(10, seed=1), random_prompt(7, seed=3)
    with served(model, clean=False) as store:
        hits = Hits(store)
        assert_same_as_cold(model, prompt, store, new=4)
        hits.last()
        assert_same_as_cold(model, prompt, store, new=4, num_beams=2, num_return_sequences=2)
        assert hits.last() == prompt.shape[1] - 1
        batch = torch.cat([prompt, torch.cat([torch.zeros(1, 3, dtype=torch.long), other], 1)])
        mask = torch.cat([torch.ones(1, 10, dtype=torch.long), (batch[1:] != 0).long()])
        assert_same_as_cold(model, batch, store, new=4, attention_mask=mask)
        # The rows share one column: row 0 reuses the 3 positions row 1's padding reaches, of its 9, and says so.
        assert hits.last() == 3
        assert store.stats().fallbacks == {"batch_layout": 1}


def test_kolibri_prompts_past_the_budget_run_cold_with_their_reason() -> None:
    model = _model("kolibri1_1")
    with served(model, clean=False) as store:
        hits = Hits(store)
        prompt = random_prompt(BUDGET + 1, seed=4)
        assert_same_as_cold(model, prompt, store, new=2)
        assert_same_as_cold(model, prompt, store, new=2)
        assert hits.last() == 0
        assert store.stats().fallbacks == {reasons.with_detail(reasons.INDEXER_TOP_K, BUDGET): 2}


def test_ovis2_5_items_span_their_framing_ids() -> None:
    """A turn adding an image reuses the first whole; another image under the same ids reuses only the text before
    its start id; framing ids in a prompt without pixels are text, cached or not."""
    model = _model("ovis2_5")
    first_image, first_kwargs = tiny_525.ovis_image(1)
    second_image, second_kwargs = tiny_525.ovis_image(2, (1, 4, 8))
    with served(model) as store:
        hits = Hits(store)
        prompt = torch.cat([random_prompt(5, seed=5), first_image, random_prompt(4, seed=6)], 1)
        out = assert_same_as_cold(model, prompt, store, new=4, **first_kwargs)
        turn = torch.cat([out.sequences, random_prompt(3, seed=7), second_image, random_prompt(2, seed=8)], 1)
        both = {name: torch.cat([first_kwargs[name], second_kwargs[name]]) for name in first_kwargs}
        assert_same_as_cold(model, turn, store, new=4, **both)
        assert hits.last() == out.sequences.shape[1] - 1
        _, other_kwargs = tiny_525.ovis_image(7)  # the first image's grid, other pixels
        assert_same_as_cold(model, prompt, store, new=4, **other_kwargs)
        assert hits.last() == 5  # the text before the image's start id
        framing = torch.tensor([[tiny_525.OVIS_IMAGE_START, tiny_525.OVIS_IMAGE_END]])  # no placeholders, no pixels
        text = torch.cat([random_prompt(6, seed=9), framing, random_prompt(3, seed=10)], 1)
        assert_same_as_cold(model, text, store, new=4)
        assert_same_as_cold(model, text, store, new=4)
        assert hits.last() == text.shape[1] - 1
