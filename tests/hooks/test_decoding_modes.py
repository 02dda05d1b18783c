"""Beams, several sampled sequences and assisted decoding reuse a stored prefix exactly, and store what they can.

Each case runs the same call cold and through a store that holds the prompt's first 30 tokens:
sequences equal, per-step logits within LOGIT_TOL, and the call's hit tokens counted, so none of
these can pass with the store running cold.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import CACHE_NAME, LOGIT_TOL, Hits, cached_model, kv_bytes_per_token, max_logit_diff, random_prompt

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.compare import served
from tests.hooks.test_batches import ROWS as BATCH_ROWS
from tests.hooks.test_batches import expected_hits, left_padded
from tests.hooks.test_batches import run as run_batch

STORED_LEN = 30
PROMPT_LEN = 40

MODES: dict[str, dict[str, Any]] = {
    "beams": {"num_beams": 3, "num_return_sequences": 2},
    "beams_from_config": {"generation_config_num_beams": 3},
    "beam_sample": {"num_beams": 2, "do_sample": True},
    "samples": {"do_sample": True, "num_return_sequences": 3},
    "prompt_lookup": {"prompt_lookup_num_tokens": 3},
    "assistant_model": {"assistant": "qwen3"},
    "static_cache": {"cache_implementation": "static"},
    "static_beams": {"cache_implementation": "static", "num_beams": 3, "num_return_sequences": 2},
    "static_samples": {"cache_implementation": "static", "do_sample": True, "num_return_sequences": 3},
}
# Full attention, sliding windows (every position kept), an indexer's keys, absolute positions.
MODELS = ("llama", "gemma3_text", "deepseek_v32", "gpt2")
# Static indexed layers keep their indexer keys in buffers of their own: a static cache runs cold there.
STATIC_COLD = {"deepseek_v32"}
# A static sliding layer keeps only its window (8 positions in the tiny Gemma 3): a call that writes past it is
# served, but its sequence cannot be copied out to store (`static_window`).
STATIC_WINDOW = {"gemma3_text"}


def _run(model: Any, ids: torch.Tensor, mode: str, store: PrefixCache | None) -> Any:
    kwargs = dict(MODES[mode])
    if "generation_config_num_beams" in kwargs:
        config = model.generation_config.__class__.from_dict(model.generation_config.to_dict())
        config.num_beams = kwargs.pop("generation_config_num_beams")
        kwargs["generation_config"] = config
    if "assistant" in kwargs:
        kwargs["assistant_model"] = cached_model(kwargs.pop("assistant"))
    if store is not None:
        kwargs[CACHE_NAME] = store
    kwargs.setdefault("do_sample", False)
    torch.manual_seed(0)
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=6,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )


@pytest.fixture
def warm_store(request: pytest.FixtureRequest) -> Any:
    model = cached_model(request.param)
    store = PrefixCache(model)
    ids = random_prompt(PROMPT_LEN, seed=11)
    stored = ids[:, :STORED_LEN]
    model.generate(
        stored, attention_mask=torch.ones_like(stored), max_new_tokens=1, do_sample=False, **{CACHE_NAME: store}
    )
    yield request.param, model, store, ids
    store.check_integrity()
    store.detach()


@pytest.mark.parametrize("warm_store", MODELS, indirect=True)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_decoding_mode_reuses_the_stored_prefix_exactly(warm_store: Any, mode: str) -> None:
    """Beams, sampled sequences and assisted decoding equal the cold call, reusing the stored prompt."""
    name, model, store, ids = warm_store
    cold = _run(model, ids, mode, None)
    hits = Hits(store)
    warm = _run(model, ids, mode, store)
    assert torch.equal(cold.sequences, warm.sequences), f"tokens differ:\n{cold.sequences}\n{warm.sequences}"
    assert max_logit_diff(cold, warm) < LOGIT_TOL
    if name in STATIC_COLD and mode.startswith("static"):
        assert hits.last() == 0
        assert store.stats().fallbacks == {"cache_implementation:static": 1}
        return
    if name in STATIC_WINDOW and mode.startswith("static"):
        assert hits.last() == STORED_LEN, "the stored 30 tokens were not reused"
        assert store.stats().fallbacks == {"static_window": 1}
        return
    assert hits.last() == STORED_LEN, "the stored 30 tokens were not reused"
    assert store.stats().fallbacks == {}


@pytest.mark.parametrize("name", ["gemma3_text", "mistral"])
@pytest.mark.parametrize("mode", ["prompt_lookup", "assistant_model"])
def test_assisted_decoding_on_sliding_layers_stores_the_whole_sequence(name: str, mode: str) -> None:
    """Assisted and prompt-lookup decoding on sliding windows (8 positions in the tiny models), past the window: the
    rejected candidates are cropped off without cutting the layers back to their window, so the call equals cold and
    its whole sequence is stored; a follow-up on it reuses all but its last token, equal to cold too."""
    model = cached_model(name)
    assert model.config.sliding_window == 8
    ids = random_prompt(PROMPT_LEN, seed=11)
    with served(model) as store:
        store_prompt(model, store, ids[:, :STORED_LEN])
        cold = _run(model, ids, mode, None)
        hits = Hits(store)
        warm = _run(model, ids, mode, store)
        assert torch.equal(cold.sequences, warm.sequences), f"tokens differ:\n{cold.sequences}\n{warm.sequences}"
        assert max_logit_diff(cold, warm) < LOGIT_TOL
        assert hits.last() == STORED_LEN
        follow = warm.sequences
        cold, warm = run_twice(model, follow, store, max_new_tokens=3)
        assert torch.equal(cold.sequences, warm.sequences)
        assert max_logit_diff(cold, warm) < LOGIT_TOL
        assert hits.last() == follow.shape[1] - 1


@pytest.mark.parametrize("warm_store", ["llama"], indirect=True)
def test_an_assistants_drafting_inside_an_assisted_call_is_counted_as_drafting(warm_store: Any) -> None:
    """An assistant with a store of its own drafts cold inside the main call, counted as `assistant_drafting` (not as
    the explicit positions transformers hands it), while the main call reuses its prefix and the assistant's store
    goes on serving the assistant's own calls."""
    _, model, store, ids = warm_store
    cold = _run(model, ids, "assistant_model", None)
    assistant = cached_model(MODES["assistant_model"]["assistant"])
    drafts = PrefixCache(assistant, attach="all")
    try:
        hits = Hits(store)
        warm = _run(model, ids, "assistant_model", store)
        assert torch.equal(cold.sequences, warm.sequences), f"tokens differ:\n{cold.sequences}\n{warm.sequences}"
        assert max_logit_diff(cold, warm) < LOGIT_TOL
        assert hits.last() == STORED_LEN
        assert store.stats().fallbacks == {}
        # The first drafting call passes no cache (later ones pass the one it returned, which is not the store's).
        assert drafts.stats().fallbacks == {"assistant_drafting": 1}
        assert drafts.stats().hit_tokens == 0
        own = Hits(drafts)
        for _ in range(2):
            assistant.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)
        assert own.last() == PROMPT_LEN - 1
        assert drafts.stats().fallbacks == {"assistant_drafting": 1}
    finally:
        drafts.detach()


@pytest.mark.parametrize("implementation", ["static", "sliding_window", "hybrid"])
def test_a_static_sliding_cache_restores_a_prefix_past_its_window(implementation: str) -> None:
    """On a model with sliding layers, `cache_implementation="static"` (and the deprecated names generate builds the same
    `StaticCache` for, asked for explicitly) gets the stored prefix's last window in each sliding buffer: equal to cold,
    the 30 stored tokens reused. The call writes past the 8-position window, so its sequence is not stored."""
    model = cached_model("gemma3_text")
    assert model.config.sliding_window == 8
    ids = random_prompt(PROMPT_LEN, seed=12)
    kwargs = {"cache_implementation": implementation, "max_new_tokens": 4}
    with served(model, clean=False) as store:
        store_prompt(model, store, ids[:, :STORED_LEN])
        hits = Hits(store)
        cold, warm = run_twice(model, ids, store, **kwargs)
        assert torch.equal(cold.sequences, warm.sequences)
        assert max_logit_diff(cold, warm) < LOGIT_TOL
        assert hits.last() == STORED_LEN
        assert store.stats().fallbacks == {"static_window": 1}
        store.check_integrity()


def test_a_static_sliding_cache_within_its_window_stores_the_sequence() -> None:
    """A static call that stays within the sliding window (3 stored + 2 new prompt tokens + 1 generated fed back) is
    copied out and stored: the same call again reuses its whole prompt but the last token."""
    model = cached_model("gemma3_text")
    ids = random_prompt(5, seed=13)
    kwargs = {"cache_implementation": "static", "max_new_tokens": 2}
    with served(model) as store:
        store_prompt(model, store, ids[:, :3])
        hits = Hits(store)
        cold, warm = run_twice(model, ids, store, **kwargs)
        assert torch.equal(cold.sequences, warm.sequences)
        assert max_logit_diff(cold, warm) < LOGIT_TOL
        assert hits.last() == 3
        again = run_twice(model, ids, store, **kwargs)[1]
        assert torch.equal(again.sequences, cold.sequences)
        assert hits.last() == 4, "the static call's sequence was not stored"
        assert store.stats().fallbacks == {}


@pytest.mark.parametrize("name", ["llama", "gemma3_text"])
def test_a_static_cache_serves_a_padded_batch_each_row_its_own_prefix(name: str) -> None:
    """A left-padded batch on a static cache restores each row's own prefix (to the column every row reaches, as on a
    dynamic cache), copied into the static buffers padding and all; afterwards each row is stored (where no sliding
    layer wrote past its window), so a follow-up on a row's answer reuses all of it."""
    model = cached_model(name)
    prompts = [random_prompt(n, seed=seed) for n, seed, _ in BATCH_ROWS]
    with served(model, clean=False) as store:
        for prompt, (_, _, stored) in zip(prompts, BATCH_ROWS, strict=True):
            store_prompt(model, store, prompt[:, :stored])
        ids, mask = left_padded(prompts)
        cold = run_batch(model, ids, mask, None, cache_implementation="static")
        hits = Hits(store)
        warm = run_batch(model, ids, mask, store, cache_implementation="static")
        assert torch.equal(cold.sequences, warm.sequences), f"tokens differ:\n{cold.sequences}\n{warm.sequences}"
        assert max_logit_diff(cold, warm) < LOGIT_TOL
        assert hits.last() == sum(expected_hits(BATCH_ROWS)) == 27 + 20 + 12
        if name in STATIC_WINDOW:  # 40 columns written into windows of 8: nothing is copied out
            assert store.stats().fallbacks == {"batch_layout": 1, "static_window": 1}
            return
        assert store.stats().fallbacks == {"batch_layout": 1}  # row 0 has 30 stored, the batch's column is 27
        width = ids.shape[1]
        answer = warm.sequences[2:, width - BATCH_ROWS[2][0] :]  # row 2's prompt and answer, without its padding
        store_prompt(model, store, answer)
        assert hits.last() == answer.shape[1] - 1
        store.check_integrity()


def store_prompt(model: Any, store: PrefixCache, ids: torch.Tensor) -> None:
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, **{CACHE_NAME: store})


def run_twice(model: Any, ids: torch.Tensor, store: PrefixCache, **kwargs: Any) -> tuple[Any, Any]:
    """The call cold, then through `store`, each from the same seed, with per-step logits."""
    outputs = []
    for cache in ({}, {CACHE_NAME: store}):
        torch.manual_seed(0)
        outputs.append(
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                **kwargs,
                **cache,
            )
        )
    return outputs[0], outputs[1]


@pytest.mark.parametrize("warm_store", ["llama"], indirect=True)
def test_beam_search_stores_the_prompt_once(warm_store: Any) -> None:
    """After beam search the whole prompt is stored (once), so the same prompt again reuses all but its last token."""
    _, model, store, ids = warm_store
    nbytes = store.stats().nbytes
    _run(model, ids, "beams", store)
    # The prompt's 10 new positions, one row of them (not one per beam).
    assert store.stats().nbytes - nbytes == (PROMPT_LEN - STORED_LEN) * kv_bytes_per_token(model)
    hits = Hits(store)
    cold = _run(model, ids, "beams", None)
    warm = _run(model, ids, "beams", store)
    assert torch.equal(cold.sequences, warm.sequences)
    assert hits.last() == PROMPT_LEN - 1


@pytest.mark.parametrize("warm_store", ["llama"], indirect=True)
def test_each_sampled_sequence_is_stored_as_its_own_entry(warm_store: Any) -> None:
    """Every sampled answer is stored, so a follow-up on any one of them reuses it whole."""
    _, model, store, ids = warm_store
    out = _run(model, ids, "samples", store)
    assert len({tuple(row.tolist()) for row in out.sequences}) > 1, "the samples should differ for this test"
    for row in out.sequences:
        follow_up = torch.cat([row[None, :], random_prompt(4, seed=3)], dim=1)
        hits = Hits(store)
        cold = _run(model, follow_up, "samples", None)
        warm = _run(model, follow_up, "samples", store)
        assert torch.equal(cold.sequences, warm.sequences)
        # The stored answer holds all its tokens but the last (never fed back).
        assert hits.last() == row.shape[0] - 1


_COMPILED = """
import sys, torch
sys.path.insert(0, "tests")
from conftest import CACHE_NAME, LOGIT_TOL, Hits, build, max_logit_diff, random_prompt
from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.compare import served
from tests.hooks.test_batches import ROWS as BATCH_ROWS
from tests.hooks.test_batches import expected_hits, left_padded
from tests.hooks.test_batches import run as run_batch

model = build("llama")
store = PrefixCache(model)
ids = random_prompt(40, seed=11)
stored = ids[:, :30]
model.generate(stored, attention_mask=torch.ones_like(stored), max_new_tokens=1, do_sample=False, **{CACHE_NAME: store})
model.forward = torch.compile(model.forward, dynamic=False)
kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, cache_implementation="static",
              output_logits=True, return_dict_in_generate=True)
cold = model.generate(ids, **kwargs)
hits = Hits(store)
warm = model.generate(ids, **kwargs, **{CACHE_NAME: store})
assert torch.equal(cold.sequences, warm.sequences), (cold.sequences, warm.sequences)
assert max_logit_diff(cold, warm) < LOGIT_TOL
assert hits.last() == 30, hits.seen
store.check_integrity()
print("compiled static: equal, 30 hit tokens")
"""


def test_a_compiled_forward_on_a_static_cache_reuses_the_stored_prefix() -> None:
    """`torch.compile(model.forward)` (default mode) with `cache_implementation="static"` equals the compiled cold call and
    reuses the stored prompt: the prefix is copied into the static buffers before the compiled steps run.

    In a fresh interpreter: dynamo's caches and guards are process-wide, and other tests' models share them."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).parents[2]
    done = subprocess.run([sys.executable, "-c", _COMPILED], capture_output=True, text=True, cwd=root, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled static: equal, 30 hit tokens" in done.stdout
