"""HunYuan-VL through the store equals cold runs: its own rotary axes, passed whole every time.

The family suite (`test_media_families.py`) runs its turns and changed images; here: an image
cached then another in the suffix (only the new one encoded), an exact repeat (no encoder
call), a hit after an unrelated request, and text-only chats. (Its text tokens keep their
sequence index, so the `rope_deltas` it leaves are mostly 0; the positions are explicit anyway.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import assert_same_as_cold, generate

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.media.grid import Medium
from hf_prefix_cache.testing.media.harness import NEW, SPECIAL_IDS
from hf_prefix_cache.testing.media.hunyuan_vl import HunYuanFamily
from hf_prefix_cache.testing.tiny_vlm_media import text

FAMILY = HunYuanFamily()
FIRST, SECOND, OTHER = Medium("image", 1, (1, 4, 6)), Medium("image", 2, (1, 4, 4)), Medium("image", 3, (1, 2, 4))


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


def encoded_rows(store: PrefixCache, ids: torch.Tensor, media: list[Medium]) -> int:
    seen: list[int] = []
    tower = FAMILY.model.model.vision_tower
    handle = tower.register_forward_hook(lambda _m, args, _o: seen.append(int(args[0].shape[0])))
    try:
        generate(FAMILY.model, ids, NEW, past_key_values=store, **FAMILY.kwargs(ids, media))
    finally:
        handle.remove()
    return sum(seen)


def cat(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts, dim=1)


def test_second_image_after_a_cached_one_then_repeat(store: PrefixCache) -> None:
    """A second image after a cached one reuses the first and encodes only the second; a repeat encodes nothing."""
    head = cat(text(4, 1), FAMILY.placeholders(FIRST), text(3, 2))
    check(store, head, [FIRST])
    ids = cat(head, text(2, 3), FAMILY.placeholders(SECOND), text(3, 4))
    store.clear()
    check(store, head, [FIRST])
    assert encoded_rows(store, ids, [FIRST, SECOND]) == 4 * 4
    _, hit = check(store, ids, [FIRST, SECOND])
    assert hit == ids.shape[1] - 1
    assert encoded_rows(store, ids, [FIRST, SECOND]) == 0


def test_hit_after_an_unrelated_request(store: PrefixCache) -> None:
    """After an unrelated request (its own rope_deltas left on the model), a hit with an image in the suffix
    equals the cold run: the whole prompt's positions are passed, never derived from the deltas."""
    model = FAMILY.model
    head = cat(text(4, 1), FAMILY.placeholders(FIRST), text(3, 2))
    ids = cat(head, text(2, 3), FAMILY.placeholders(SECOND), text(3, 4))
    check(store, head, [FIRST])
    other = cat(text(2, 7), FAMILY.placeholders(OTHER))
    generate(model, other, NEW, **FAMILY.kwargs(other, [OTHER]))
    _, hit = check(store, ids, [FIRST, SECOND])
    assert hit == head.shape[1]


def test_text_only_chat(store: PrefixCache) -> None:
    """Text-only prompts are served (positions on every rotary axis), turn after turn."""
    turn, previous = text(20, 9), 1
    for i in range(3):
        out, hit = check(store, turn, [])
        assert hit == previous - 1
        previous = out.sequences.shape[1]
        turn = cat(out.sequences, text(4, 20 + i))
