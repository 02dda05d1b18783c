"""Models with recurrent states (hybrids and pure SSMs) in every decoding mode: batches, left padding, beams, samples.

Each row is restored and prefilled alone, then the rows are joined (`hooks/recurrent_rows.py`).
Every case runs the same call cold and through a store: tokens equal, per-step logits within
LOGIT_TOL, and the hit tokens counted exactly, so none of these can pass with the store cold.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import CACHE_NAME, LOGIT_TOL, Hits, cached_model, max_logit_diff, random_prompt
from transformers import pipeline

from hf_prefix_cache import PrefixCache
from hf_prefix_cache._compat import LINEAR_LAYERS_CROP
from hf_prefix_cache.testing.tiny_attention import tiny_qwen4_exp
from hf_prefix_cache.testing.tiny_processors import tiny_tokenizer
from tests.hooks.test_batches import left_padded, run

# Hybrids of each kind of state (Mamba-2, gated delta net, Mamba-1, parallel Mamba-2 + attention, short conv,
# conv + sliding attention) and pure SSMs, whose cache has no keys at all.
MODELS = ("bamba", "qwen3_next", "jamba", "falcon_h1", "lfm2", "zamba", "inkling_text", "mamba2", "mamba")
MODES: dict[str, dict[str, Any]] = {
    "greedy": {},
    "beams": {"num_beams": 3, "num_return_sequences": 2},
    "beam_sample": {"num_beams": 2, "do_sample": True},
    "samples": {"do_sample": True, "num_return_sequences": 3},
}
# (prompt length, seed, tokens of it stored beforehand) per row; the last row is one token, behind 39 of padding.
ROWS = ((40, 1, 30), (33, 2, 20), (25, 3, 24), (1, 4, 0))


def _store_prefixes(model: Any, store: PrefixCache, prompts: list[torch.Tensor], rows: Any) -> None:
    for prompt, (_, _, k) in zip(prompts, rows, strict=True):
        if k:
            stored = prompt[:, :k]
            model.generate(stored, attention_mask=torch.ones_like(stored), max_new_tokens=1, **{CACHE_NAME: store})


@pytest.fixture
def stored(request: pytest.FixtureRequest) -> Any:
    """A store holding the first tokens of each row's prompt, each stored alone."""
    model = cached_model(request.param)
    store = PrefixCache(model)
    prompts = [random_prompt(n, seed=seed) for n, seed, _ in ROWS]
    _store_prefixes(model, store, prompts, ROWS)
    yield model, store, prompts
    store.check_integrity()
    store.detach()


def _same(cold: Any, warm: Any) -> None:
    assert torch.equal(cold.sequences, warm.sequences), f"tokens differ:\n{cold.sequences}\n{warm.sequences}"
    assert max_logit_diff(cold, warm) < LOGIT_TOL


@pytest.mark.parametrize("stored", MODELS, indirect=True)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_left_padded_batch_with_states_restores_each_rows_own_prefix(stored: Any, mode: str) -> None:
    """Rows of different lengths (one of a single token) equal the cold batch and each reuses all it has stored."""
    model, store, prompts = stored
    ids, mask = left_padded(prompts)
    cold = run(model, ids, mask, None, **MODES[mode])
    hits = Hits(store)
    warm = run(model, ids, mask, store, **MODES[mode])
    _same(cold, warm)
    # Rows prefilled alone reuse every stored token: no shared column cuts a padded row's reuse.
    assert hits.last() == 30 + 20 + 24
    assert store.stats().fallbacks == {}


@pytest.mark.parametrize("stored", ["bamba", "mamba2"], indirect=True)
def test_one_left_padded_row_with_states_reuses_its_prefix(stored: Any) -> None:
    """A single row behind padding (a batch of one from a padding tokenizer) is served like a row of a batch."""
    model, store, prompts = stored
    ids, mask = left_padded(prompts[:2])
    ids, mask = ids[1:], mask[1:]  # 33 tokens behind 7 columns of padding
    cold = run(model, ids, mask, None)
    hits = Hits(store)
    warm = run(model, ids, mask, store)
    _same(cold, warm)
    assert hits.last() == 20
    assert store.stats().fallbacks == {}


@pytest.mark.parametrize("stored", ["bamba", "qwen3_next"], indirect=True)
@pytest.mark.parametrize("mode", ["beams", "samples", "beams_from_config"])
def test_one_prompt_expanded_to_beams_or_samples_reuses_its_prefix(stored: Any, mode: str) -> None:
    """One prompt, restored and prefilled once, expanded to its beams or samples (keys and states alike)."""
    model, store, prompts = stored
    ids = prompts[0]
    kwargs = dict(MODES.get(mode, {}))
    if mode == "beams_from_config":
        config = model.generation_config.__class__.from_dict(model.generation_config.to_dict())
        config.num_beams = 3
        kwargs["generation_config"] = config
    cold = run(model, ids, torch.ones_like(ids), None, **kwargs)
    hits = Hits(store)
    warm = run(model, ids, torch.ones_like(ids), store, **kwargs)
    _same(cold, warm)
    assert hits.last() == 30
    assert store.stats().fallbacks == {}


@pytest.mark.parametrize("name", ["bamba", "qwen3_next"])
def test_rows_after_a_shared_prefix_restore_from_the_first_rows_snapshot(name: str) -> None:
    """A system prompt stored with another question has no snapshot at its end: the batch's first row computes it
    and stores its snapshot there before the next rows restore, so only that row computes the shared prefix."""
    model = cached_model(name)
    store = PrefixCache(model)
    try:
        system = random_prompt(30, seed=15)
        questions = [torch.cat([system, random_prompt(4 + 3 * i, seed=300 + i)], 1) for i in range(4)]
        _store_prefixes(model, store, questions[:1], [(0, 0, questions[0].shape[1])])
        ids, mask = left_padded(questions[1:])
        cold = run(model, ids, mask, None)
        hits = Hits(store)
        warm = run(model, ids, mask, store)
        _same(cold, warm)
        assert hits.last() == 0 + 30 + 30
        assert store.stats().fallbacks == {}
        store.check_integrity()
    finally:
        store.detach()


@pytest.mark.parametrize("stored", ["bamba"], indirect=True)
def test_after_beams_the_prompt_is_stored_once(stored: Any) -> None:
    """Beams reorder the rows, so each prompt row is stored from its own prefill: the same call again reuses all but
    its last token."""
    model, store, prompts = stored
    ids, mask = left_padded(prompts[:3])
    run(model, ids, mask, store, **MODES["beams"])
    hits = Hits(store)
    cold = run(model, ids, mask, None, **MODES["beams"])
    warm = run(model, ids, mask, store, **MODES["beams"])
    _same(cold, warm)
    assert hits.last() == 39 + 32 + 24


@pytest.mark.parametrize("stored", ["qwen3_next", "mamba"], indirect=True)
def test_each_sampled_row_with_states_is_stored_as_its_own_entry(stored: Any) -> None:
    """Every sampled answer is stored with its own final state, so a follow-up on any of them reuses it whole."""
    model, store, prompts = stored
    out = run(model, prompts[0], torch.ones_like(prompts[0]), store, **MODES["samples"])
    assert len({tuple(row.tolist()) for row in out.sequences}) > 1, "the samples should differ for this test"
    for row in out.sequences:
        follow_up = torch.cat([row[None, :], random_prompt(4, seed=3)], dim=1)
        hits = Hits(store)
        cold = run(model, follow_up, torch.ones_like(follow_up), None)
        warm = run(model, follow_up, torch.ones_like(follow_up), store)
        _same(cold, warm)
        assert hits.last() == row.shape[0] - 1  # the answer's last token was never fed back


def test_a_pipeline_batch_on_a_hybrid_model_reuses_the_shared_prefix() -> None:
    """`pipeline(..., batch_size=2)` left-pads each batch; every row reuses the stored system text, as cold."""
    model = cached_model("qwen3_next")
    tokenizer = tiny_tokenizer(["<image>"])
    tokenizer.padding_side = "left"
    store = PrefixCache(model)
    try:
        generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
        system = "the cat sat on the mat and " * 4
        texts = [system + tail for tail in ("what is in the image", "tell me", "describe this picture please")]
        system_ids = tokenizer(system, return_tensors="pt").input_ids
        model.generate(system_ids, attention_mask=torch.ones_like(system_ids), max_new_tokens=1, past_key_values=store)
        cold = generator(texts, max_new_tokens=5, do_sample=False, batch_size=2)
        hits = Hits(store)
        warm = generator(texts, max_new_tokens=5, do_sample=False, batch_size=2, past_key_values=store)
        assert cold == warm
        # The system text and the first token of its answer, stored with the state after them, in every row.
        assert hits.last() == 3 * system_ids.shape[1]
        assert store.stats().fallbacks == {}
    finally:
        store.detach()


# From transformers 5.25 `crop` rolls recurrent states back: prompt lookup is served on Mamba-2, conv and parallel
# hybrids; a gated delta-rule mixer (Qwen3-Next), Mamba-1's scan (Jamba) and sliding keys (Inkling) run it cold.
ASSISTED_SERVED = ("bamba", "lfm2", "falcon_h1")
ASSISTED_COLD = ("qwen3_next", "jamba", "inkling_text")


@pytest.mark.skipif(not LINEAR_LAYERS_CROP, reason="transformers < 5.25 refuses assisted decoding on stateful models")
@pytest.mark.parametrize("stored", ASSISTED_SERVED + ASSISTED_COLD, indirect=True)
def test_prompt_lookup_on_states_reuses_the_prefix_exactly_or_runs_cold_by_name(
    stored: Any, request: pytest.FixtureRequest
) -> None:
    """Prompt lookup over a prompt whose first 30 tokens are stored: equal to cold, the stored prefix reused where
    the rollback keeps the states exact, else cold as `assisted_decoding`; the states it stores serve a next turn."""
    model, store, prompts = stored
    ids = prompts[0]
    lookup = torch.cat([ids, ids[:, :12]], dim=1)  # a repeated stretch, so candidates are found and some rejected
    cold = run(model, lookup, torch.ones_like(lookup), None, prompt_lookup_num_tokens=3)
    hits = Hits(store)
    warm = run(model, lookup, torch.ones_like(lookup), store, prompt_lookup_num_tokens=3)
    _same(cold, warm)
    if request.node.callspec.params["stored"] in ASSISTED_COLD:
        assert hits.last() == 0
        assert store.stats().fallbacks == {"assisted_decoding": 1}
        return
    assert hits.last() == 30, "the 30 stored tokens were not reused"
    assert store.stats().fallbacks == {}
    # Its sequence is stored with the state after it (no snapshot inside the prompt: generate fed all of it): a
    # plain next turn reuses all of it but the last token.
    turn = torch.cat([warm.sequences, prompts[1][:, :6]], dim=1)
    _same(run(model, turn, torch.ones_like(turn), None), run(model, turn, torch.ones_like(turn), store))
    assert hits.last() == warm.sequences.shape[1] - 1, "the assisted call's own sequence was not stored"


@pytest.mark.skipif(LINEAR_LAYERS_CROP, reason="transformers >= 5.25 runs assisted decoding on stateful models")
@pytest.mark.parametrize("stored", ["bamba"], indirect=True)
def test_assisted_decoding_on_states_is_left_to_transformers_refusal(stored: Any) -> None:
    """Before 5.25, prompt lookup would crop rejected candidates, which a recurrent state cannot undo: the call runs
    cold, as `assisted_decoding`, and transformers refuses it for stateful models exactly as without the store."""
    model, store, prompts = stored
    ids = prompts[0]
    with pytest.raises(ValueError, match="stateful") as cold:
        run(model, ids, torch.ones_like(ids), None, prompt_lookup_num_tokens=3)
    with pytest.raises(ValueError, match="stateful") as warm:
        run(model, ids, torch.ones_like(ids), store, prompt_lookup_num_tokens=3)
    assert str(cold.value) == str(warm.value)
    assert store.stats().fallbacks == {"assisted_decoding": 1}


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ({}, "batch_size"),
        ({"num_beams": 2}, "beam_search"),
        ({"do_sample": True, "num_return_sequences": 2}, "num_return_sequences"),
    ],
    ids=["padded_batch", "beams", "samples"],
)
def test_states_beside_indexed_attention_run_rows_cold_with_a_reason(mode: dict[str, Any], reason: str) -> None:
    """Qwen4-Exp's indexers keep positions a padded row does not share and watch ties per call, so its batches,
    beams and samples run cold, counted (row by row, a padded batch was 5e-2 off its cold run)."""
    model = tiny_qwen4_exp()
    store = PrefixCache(model)
    try:
        prompts = [random_prompt(n, seed=seed) for n, seed, _ in ROWS[:2]]
        _store_prefixes(model, store, prompts, ROWS[:2])
        ids, mask = left_padded(prompts) if not mode else (prompts[0], torch.ones_like(prompts[0]))
        cold = run(model, ids, mask, None, **mode)
        warm = run(model, ids, mask, store, **mode)
        _same(cold, warm)
        assert store.stats().fallbacks == {reason: 1}
    finally:
        store.detach()


def test_a_padded_batch_under_a_byte_budget_reuses_what_was_stored_before_it() -> None:
    """Eight rows, six with a stored prefix, under a budget that holds those six entries: every row is restored (and
    so pinned) before any row is stored, so the two new rows' entries cannot evict what the others restore."""
    model = cached_model("bamba")
    prompts = [random_prompt(20 + i, seed=40 + i) for i in range(8)]

    def fill(store: PrefixCache) -> None:
        for prompt in prompts[2:]:
            stored = prompt[:, :-3]
            model.generate(stored, attention_mask=torch.ones_like(stored), max_new_tokens=1, **{CACHE_NAME: store})

    sizing = PrefixCache(model)
    fill(sizing)
    budget = sizing.stats().nbytes
    sizing.detach()
    store = PrefixCache(model, max_bytes=budget)
    try:
        fill(store)
        assert store.stats().entries == 6 and store.stats().evictions == 0
        ids, mask = left_padded(prompts)
        cold = run(model, ids, mask, None)
        hits = Hits(store)
        warm = run(model, ids, mask, store)
        _same(cold, warm)
        # Each stored row reuses its stored prompt (all of it: its last token and the generated one sit past it).
        assert hits.last() == sum(p.shape[1] - 3 for p in prompts[2:])
        assert store.stats().evictions > 0  # the new rows were stored, evicting once the six were used
        store.check_integrity()
    finally:
        store.detach()
