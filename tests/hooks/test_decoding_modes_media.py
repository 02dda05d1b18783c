"""Beams and several sampled sequences on prompts with media reuse a stored prefix exactly, and store what they can.

A store holds a prompt with one image; the call extends it with two more images (in the uncached
suffix) and runs beams or samples. Each case runs cold and through the store: sequences equal,
per-step logits within LOGIT_TOL, the stored prefix counted as hit tokens. LLaVA (images as
whole items), Qwen2-VL (M-RoPE positions over the whole prompt) and Qwen3-VL (M-RoPE with
deepstack features), whose encoded media `generate` copies to each row.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import CACHE_NAME, LOGIT_TOL, Hits, max_logit_diff

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.media.families import SPECIAL_IDS, Family
from hf_prefix_cache.testing.tiny_vlm_media import text

MODES: dict[str, dict[str, Any]] = {
    "beams": {"num_beams": 3, "num_return_sequences": 2},
    "samples": {"do_sample": True, "num_return_sequences": 3},
}
FAMILIES = ("llava", "qwen2_vl", "qwen3_vl")


def _generate(fam: Family, ids: torch.Tensor, images: list[Any], store: PrefixCache | None, **mode: Any) -> Any:
    kwargs = {**fam.kwargs(ids, images), "suppress_tokens": SPECIAL_IDS, **mode}
    if store is not None:
        kwargs[CACHE_NAME] = store
    kwargs.setdefault("do_sample", False)
    kwargs.setdefault("max_new_tokens", 5)
    torch.manual_seed(0)
    return fam.model.generate(
        ids, attention_mask=torch.ones_like(ids), output_logits=True, return_dict_in_generate=True, **kwargs
    )


def _same_as_cold(fam: Family, ids: torch.Tensor, images: list[Any], store: PrefixCache, **mode: Any) -> Any:
    cold = _generate(fam, ids, images, None, **mode)
    warm = _generate(fam, ids, images, store, **mode)
    assert torch.equal(cold.sequences, warm.sequences), f"tokens differ:\n{cold.sequences}\n{warm.sequences}"
    assert max_logit_diff(cold, warm) < LOGIT_TOL
    return warm


@pytest.fixture(params=FAMILIES)
def warm(request: pytest.FixtureRequest) -> Iterator[tuple[Family, PrefixCache, torch.Tensor, torch.Tensor, list[Any]]]:
    """A store holding a prompt with one image, and a longer prompt adding two images after it."""
    fam = Family(request.param)
    store = PrefixCache(fam.model)
    images = [fam.image(1), fam.image(2), fam.image(3)]
    prefix = torch.cat([text(5, 1), fam.placeholders(images[0]), text(6, 2)], dim=1)
    ids = torch.cat(
        [prefix, text(4, 3), fam.placeholders(images[1]), text(3, 4), fam.placeholders(images[2]), text(2, 5)], dim=1
    )
    _generate(fam, prefix, images[:1], store, max_new_tokens=1)  # stores the prefix (its one new token is not fed)
    yield fam, store, prefix, ids, images
    store.check_integrity()
    assert not store.stats().fallbacks, store.stats().fallbacks
    store.detach()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_media_prompts_with_beams_or_samples_reuse_the_stored_prefix(warm: Any, mode: str) -> None:
    """The stored image and text are restored once into every row; the suffix's two images reach each row whole."""
    fam, store, prefix, ids, images = warm
    hits = Hits(store)
    _same_as_cold(fam, ids, images, store, **MODES[mode])
    assert hits.last() == prefix.shape[1]


def test_beams_store_the_prompt_with_its_media_once(warm: Any) -> None:
    """After beam search the whole prompt (media symbols included) is stored: the same prompt reuses all but its
    last token, with none of its images encoded again."""
    fam, store, _, ids, images = warm
    _same_as_cold(fam, ids, images, store, **MODES["beams"])
    hits = Hits(store)
    _same_as_cold(fam, ids, images, store, **MODES["samples"])
    assert hits.last() == ids.shape[1] - 1
    assert fam.encoded(ids, images, store) == 0


def test_each_sample_is_stored_with_its_media(warm: Any) -> None:
    """Every sampled answer is stored as its own sequence, media symbols included: a follow-up on any one of them
    reuses it whole."""
    fam, store, _, ids, images = warm
    out = _same_as_cold(fam, ids, images, store, **MODES["samples"])
    assert len({tuple(row.tolist()) for row in out.sequences}) > 1, "the samples should differ for this test"
    for row in out.sequences:
        follow_up = torch.cat([row[None, :], text(3, 9)], dim=1)
        hits = Hits(store)
        _same_as_cold(fam, follow_up, images, store)
        assert hits.last() == row.shape[0] - 1  # all of the answer but its last token (never fed back)


@pytest.mark.parametrize("name", ["qwen2_audio", "glm4v"])
def test_media_copied_otherwise_run_expanded_calls_cold(name: str) -> None:
    """`generate` copies Qwen2-Audio's features clip by clip, and GLM-4V's own copy interleaves encoded images
    ([A, A, B, B]): a hit, handed only the suffix's items, could not give the rows what a cold call gives them, so
    beams and samples with such media run cold (`media_batch`), equal to the cold call."""
    fam = Family(name)
    store = PrefixCache(fam.model)
    try:
        items = [fam.image(1), fam.image(2)]
        prefix = torch.cat([text(3, 1), fam.placeholders(items[0]), text(2, 2)], dim=1)
        ids = torch.cat([prefix, fam.placeholders(items[1]), text(2, 3)], dim=1)
        _generate(fam, prefix, items[:1], store, max_new_tokens=1)
        for mode in sorted(MODES):
            _same_as_cold(fam, ids, items, store, **MODES[mode])
        assert store.stats().fallbacks == {"media_batch": 2}
        assert store.stats().hit_tokens == 0
    finally:
        store.detach()
