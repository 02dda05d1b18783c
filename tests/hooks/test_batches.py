"""Batches: each row restores its own stored prefix, left padding included, and every row is stored.

Rows share the working cache's columns, so a row reuses its stored prefix up to the column every
row reaches (its left padding plus its stored prefix); `generate` gets the caller's ids and mask
unchanged. Every case runs the same call cold and through the store: tokens equal, logits within
LOGIT_TOL, and the hit tokens counted exactly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import CACHE_NAME, LOGIT_TOL, Hits, cached_model, max_logit_diff, random_prompt

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.tiny_build import PAD_ID

# (prompt length, seed, tokens of it stored beforehand) per row
ROWS = ((40, 1, 30), (33, 2, 20), (25, 3, 24))
MODELS = ("llama", "gemma3_text", "gpt2", "deepseek_v32", "mistral")


def left_padded(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts as one batch, padded on the left as tokenizers do with `padding_side="left"`."""
    width = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), width), PAD_ID)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - p.shape[1] :], mask[i, width - p.shape[1] :] = p[0], 1
    return ids, mask


def expected_hits(rows: tuple[tuple[int, int, int], ...]) -> list[int]:
    """Each row's reuse: its stored tokens up to the column that every row's padding plus stored prefix reaches."""
    width = max(n for n, _, _ in rows)
    reach = min(width - n + stored for n, _, stored in rows)
    return [max(reach - (width - n), 0) for n, _, _ in rows]


def run(model: Any, ids: torch.Tensor, mask: torch.Tensor, store: PrefixCache | None, **kwargs: Any) -> Any:
    if store is not None:
        kwargs[CACHE_NAME] = store
    kwargs.setdefault("do_sample", False)
    torch.manual_seed(0)
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=5, output_logits=True, return_dict_in_generate=True, **kwargs
    )


@pytest.fixture
def stored(request: pytest.FixtureRequest) -> Any:
    """A store holding the first tokens of each row's prompt, each stored alone."""
    model = cached_model(request.param)
    store = PrefixCache(model)
    prompts = [random_prompt(n, seed=seed) for n, seed, _ in ROWS]
    for prompt, (_, _, k) in zip(prompts, ROWS, strict=True):
        model.generate(
            prompt[:, :k],
            attention_mask=torch.ones_like(prompt[:, :k]),
            max_new_tokens=1,
            do_sample=False,
            **{CACHE_NAME: store},
        )
    yield model, store, prompts
    store.check_integrity()
    store.detach()


@pytest.mark.parametrize("stored", MODELS, indirect=True)
@pytest.mark.parametrize(
    "mode", [{}, {"num_beams": 2}, {"do_sample": True, "num_return_sequences": 2}], ids=["greedy", "beams", "samples"]
)
def test_a_left_padded_batch_restores_each_rows_own_prefix(stored: Any, mode: dict[str, Any]) -> None:
    """Rows of different lengths, each extending a different stored prompt, equal the cold batch and reuse their own."""
    model, store, prompts = stored
    ids, mask = left_padded(prompts)
    cold = run(model, ids, mask, None, **mode)
    hits = Hits(store)
    warm = run(model, ids, mask, store, **mode)
    assert torch.equal(cold.sequences, warm.sequences), f"tokens differ:\n{cold.sequences}\n{warm.sequences}"
    assert max_logit_diff(cold, warm) < LOGIT_TOL
    assert hits.last() == sum(expected_hits(ROWS)) == 27 + 20 + 12
    # Row 0 has 30 stored but the shared column lets it reuse 27: the loss is counted, not silent.
    assert store.stats().fallbacks == {"batch_layout": 1}


@pytest.mark.parametrize("stored", ["llama"], indirect=True)
def test_equal_rows_extending_different_prompts_reuse_more_than_they_share(stored: Any) -> None:
    """Rows with no token in common each reuse their stored prefix, up to the shortest (they share no prefix)."""
    model, store, prompts = stored
    ids = torch.cat([p[:, :25] for p in prompts])  # equal lengths, no padding, no common prefix
    mask = torch.ones_like(ids)
    cold = run(model, ids, mask, None)
    hits = Hits(store)
    warm = run(model, ids, mask, store)
    assert torch.equal(cold.sequences, warm.sequences)
    assert max_logit_diff(cold, warm) < LOGIT_TOL
    # Stored 30, 20 and 24 tokens: every row reaches column 20, and the rows that had more say so.
    assert hits.last() == 3 * 20
    assert store.stats().fallbacks == {"batch_layout": 1}


@pytest.mark.parametrize("stored", ["llama"], indirect=True)
def test_a_longest_row_with_nothing_stored_leaves_the_batch_cold_and_says_so(stored: Any) -> None:
    """A padded batch whose longest row has nothing stored restores no row (they share column 0): still equal to
    cold, and the stored prefixes the other rows could not use are counted as `batch_layout`, not lost in silence."""
    model, store, prompts = stored
    fresh = random_prompt(45, seed=99)  # longer than every other row, nothing of it stored
    ids, mask = left_padded([fresh, *prompts[1:]])
    cold = run(model, ids, mask, None)
    hits = Hits(store)
    warm = run(model, ids, mask, store)
    assert torch.equal(cold.sequences, warm.sequences)
    assert max_logit_diff(cold, warm) < LOGIT_TOL
    assert hits.last() == 0
    assert store.stats().fallbacks == {"batch_layout": 1}


@pytest.mark.parametrize("stored", ["llama"], indirect=True)
def test_every_row_of_a_padded_batch_is_stored(stored: Any) -> None:
    """After a padded batch, each row's own sequence (without its padding) is stored whole."""
    model, store, prompts = stored
    ids, mask = left_padded(prompts)
    out = run(model, ids, mask, store)
    for row, prompt in zip(out.sequences, prompts, strict=True):
        sequence = row[ids.shape[1] - prompt.shape[1] :][None]  # the row without its padding
        hits = Hits(store)
        one = run(model, sequence, torch.ones_like(sequence), store)
        assert torch.equal(one.sequences, run(model, sequence, torch.ones_like(sequence), None).sequences)
        assert hits.last() == sequence.shape[1] - 1


@pytest.mark.parametrize(
    ("name", "make", "reason"),
    [
        ("llama", lambda ids, mask: (ids, mask.flip(-1)), "padding"),  # right padding
        ("bamba", lambda ids, mask: (ids, mask.flip(-1)), "padding"),  # recurrent states too
    ],
    ids=["right_padding", "state_model_right_padding"],
)
def test_padding_that_cannot_restore_exactly_runs_cold_with_a_reason(name: str, make: Any, reason: str) -> None:
    """Right padding runs cold and says why, on attention and recurrent models alike."""
    model = cached_model(name)
    store = PrefixCache(model)
    try:
        ids, mask = make(*left_padded([random_prompt(n, seed=seed) for n, seed, _ in ROWS]))
        cold = run(model, ids, mask, None)
        warm = run(model, ids, mask, store)
        assert torch.equal(cold.sequences, warm.sequences)
        assert store.stats().fallbacks == {reason: 1}
    finally:
        store.detach()
