"""Cosmos 3 Edge through the store equals cold runs: three rotary rows of the whole prompt, passed every time.

The family suite (`test_media_families.py`) runs its turns, changed images and videos; here: a
video after a cached image with an unrelated request in between (its `rope_deltas` left on the
model), where the model's own path on the same restored prefix differs, and text-only chats.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import assert_same_as_cold, generate, max_logit_diff
from transformers import DynamicCache

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.media.cosmos3_edge import Cosmos3EdgeFamily
from hf_prefix_cache.testing.media.grid import Medium
from hf_prefix_cache.testing.media.harness import NEW, SPECIAL_IDS
from hf_prefix_cache.testing.tiny_vlm_media import text

FAMILY = Cosmos3EdgeFamily()
IMAGE, VIDEO, OTHER = Medium("image", 1, (1, 4, 6)), Medium("video", 5, (2, 2, 4)), Medium("image", 3, (1, 2, 4))


@pytest.fixture
def store() -> Iterator[PrefixCache]:
    cache = PrefixCache(FAMILY.model)
    yield cache
    cache.check_integrity()
    assert not cache.stats().fallbacks, cache.stats().fallbacks
    cache.detach()


def check(store: PrefixCache, ids: torch.Tensor, media: list[Medium]) -> tuple[Any, int]:
    """Cold and through `store`; the cached run and its hit tokens."""
    before = store.stats().hit_tokens
    kwargs = {**FAMILY.kwargs(ids, media), "suppress_tokens": SPECIAL_IDS}
    out = assert_same_as_cold(FAMILY.model, ids, store, new=NEW, **kwargs)
    return out, store.stats().hit_tokens - before


def cat(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts, dim=1)


def test_stale_rope_deltas_are_never_used(store: PrefixCache) -> None:
    """After an unrelated request leaves its rope_deltas, a hit with a video in the suffix equals the cold run;
    the model's own path on the same restored prefix reads the stale deltas and differs."""
    model = FAMILY.model
    head = cat(text(4, 1), FAMILY.placeholders(IMAGE), text(3, 2))
    ids = cat(head, text(2, 3), FAMILY.placeholders(VIDEO), text(3, 4))
    check(store, head, [IMAGE])
    other = cat(text(2, 7), FAMILY.placeholders(OTHER), text(9, 8))
    generate(model, other, NEW, **FAMILY.kwargs(other, [OTHER]))
    stale = model.model.rope_deltas.clone()
    _, hit = check(store, ids, [IMAGE, VIDEO])
    assert hit == head.shape[1]
    short = cat(head, text(3, 5))
    cold = generate(model, short, NEW, **FAMILY.kwargs(short, [IMAGE]))
    cache = DynamicCache()
    with torch.no_grad():
        model(head, attention_mask=torch.ones_like(head), past_key_values=cache, **FAMILY.kwargs(head, [IMAGE]))
    model.model.rope_deltas = stale
    builtin = generate(model, short, NEW, past_key_values=cache)
    assert max_logit_diff(builtin, cold) > 1e-4


def test_text_only_chat(store: PrefixCache) -> None:
    """Text-only prompts are served (three rotary rows), turn after turn."""
    turn, previous = text(20, 9), 1
    for i in range(3):
        out, hit = check(store, turn, [])
        assert hit == previous - 1
        previous = out.sequences.shape[1]
        turn = cat(out.sequences, text(4, 20 + i))
