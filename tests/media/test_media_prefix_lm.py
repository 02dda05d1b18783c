"""PaliGemma (prefix-LM: the whole prompt attends both ways) reuses only an identical prompt, exactly."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from conftest import assert_same_as_cold

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.tiny_vlm_media import llava_pixels, run, text
from hf_prefix_cache.testing.tiny_vlm_parts import IMAGE_ID
from hf_prefix_cache.testing.tiny_vlms import cached_vlm

NEW = 5


@pytest.fixture
def store() -> Iterator[PrefixCache]:
    store = PrefixCache(cached_vlm("paligemma"))
    yield store
    store.check_integrity()
    store.detach()


def _check(store: PrefixCache, ids: torch.Tensor, images: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Cold vs store; returns the sequences and the prompt tokens this request took from the store."""
    before = store.stats().hit_tokens
    kwargs = {"pixel_values": torch.stack(images), "token_type_ids": torch.zeros_like(ids)} if images else {}
    out = assert_same_as_cold(store.model, ids, store, new=NEW, **kwargs)
    return out.sequences, store.stats().hit_tokens - before


def _prompt(num_images: int, seed: int, n: int = 6) -> torch.Tensor:
    return torch.cat([run(IMAGE_ID, 16 * num_images), run(1, 1), text(n, seed)], dim=1)


def test_identical_prompt_is_reused(store: PrefixCache) -> None:
    """Repeating an image prompt reuses all but its last token."""
    ids = _prompt(2, 1)
    _check(store, ids, [llava_pixels(1), llava_pixels(2)])
    _, hit = _check(store, ids, [llava_pixels(1), llava_pixels(2)])
    assert hit == ids.shape[1] - 1


def test_changed_image_with_identical_tokens_reuses_nothing(store: PrefixCache) -> None:
    """The same ids with another image share no stored state."""
    ids = _prompt(1, 1)
    _check(store, ids, [llava_pixels(1)])
    _, hit = _check(store, ids, [llava_pixels(7)])
    assert hit == 0


@pytest.mark.parametrize("extra_image", [False, True])
def test_longer_prompts_are_not_served_from_a_shorter_one(store: PrefixCache, extra_image: bool) -> None:
    """A follow-up turn (or one more image) changes the bidirectional prefix: computed cold, still exact."""
    first = _prompt(1, 1)
    seqs, _ = _check(store, first, [llava_pixels(1)])
    if extra_image:
        follow = _prompt(2, 1)
        images = [llava_pixels(1), llava_pixels(2)]
    else:
        follow = torch.cat([seqs, text(4, 3)], dim=1)
        images = [llava_pixels(1)]
    _, hit = _check(store, follow, images)
    assert hit == 0
    _, hit = _check(store, follow, images)
    assert hit == follow.shape[1] - 1


def test_text_only_prompts_follow_the_same_rule(store: PrefixCache) -> None:
    """Text-only prompts are prefix-LM too: a repeat is reused, an extension is not."""
    ids = text(12, 5)
    seqs, _ = _check(store, ids, [])
    assert _check(store, ids, [])[1] == ids.shape[1] - 1
    assert _check(store, torch.cat([seqs, text(3, 6)], dim=1), [])[1] == 0
    assert not store.stats().fallbacks


def test_batches_run_cold(store: PrefixCache) -> None:
    """Several rows run cold (`prefix_lm_batch`): the prompt namespace is per row."""
    ids = text(12, 5).repeat(2, 1)
    for _ in range(2):
        assert_same_as_cold(store.model, ids, store, new=3)
    assert store.stats().fallbacks == {"prefix_lm_batch": 2}


def test_other_token_type_ids_share_nothing(store: PrefixCache) -> None:
    """`token_type_ids` mark prefix (0) and suffix (1) positions and change the mask, as does passing none:
    the same prompt with other marks is its own entry (reusing was 1.3e-3 off)."""
    ids = _prompt(1, 1)
    pixels = llava_pixels(1)[None]
    suffix_marked = torch.zeros_like(ids)
    suffix_marked[0, -3:] = 1
    for i, marks in enumerate((suffix_marked, torch.zeros_like(ids), None, suffix_marked)):
        before = store.stats().hit_tokens
        extra = {"token_type_ids": marks} if marks is not None else {}
        assert_same_as_cold(store.model, ids, store, new=NEW, pixel_values=pixels, **extra)
        reused = store.stats().hit_tokens - before
        assert reused == (ids.shape[1] - 1 if i == 3 else 0)  # only the repeat of the first marks reuses
