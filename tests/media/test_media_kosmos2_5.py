"""Kosmos-2.5's image (`multimodal/kosmos2_5.py`) is served exactly: reused whole with its prompt's head, or not at all.

Every request runs cold and through the store: equal tokens, logits within 1e-4, the image and
its position mask passed every time as the processor would.
"""

from __future__ import annotations

from typing import Any

import torch
from conftest import Hits

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.multimodal.kosmos2_5 import Kosmos2_5Media
from hf_prefix_cache.testing.media import harness
from hf_prefix_cache.testing.media.kosmos2_5 import head, media_kwargs, tiny_kosmos2_5
from hf_prefix_cache.testing.tiny_vlm_media import text
from media.conftest import store_fixture

store = store_fixture(tiny_kosmos2_5, no_fallbacks=False)


def check(ids: torch.Tensor, seed: int | None, store: PrefixCache, **override: Any) -> Any:
    """`harness.check` with the image of `seed` (none: a text-only call) and its position mask."""
    return harness.check(tiny_kosmos2_5(), ids, store, media_kwargs(ids, seed), **override)


def test_kosmos2_5_gets_its_adapter() -> None:
    assert isinstance(media_adapter_for(tiny_kosmos2_5()), Kosmos2_5Media)


def test_a_follow_up_reuses_the_image_and_its_text(store: PrefixCache) -> None:
    """A second turn reuses the image and the first turn whole; its repeat all but the last token."""
    hits = Hits(store)
    answer = check(torch.cat([head(), text(6, 2)], dim=1), 1, store).sequences
    second = torch.cat([answer, text(5, 3)], dim=1)
    reused = []
    for _ in range(2):
        check(second, 1, store)
        reused.append(hits.last())
    assert reused == [answer.shape[1] - 1, second.shape[1] - 1]
    assert not store.stats().fallbacks, store.stats().fallbacks


def test_another_image_reuses_nothing(store: PrefixCache) -> None:
    """The image spans the prompt's head from BOS: with other patches nothing is reused, then all of it."""
    hits = Hits(store)
    ids = torch.cat([head(), text(6, 2)], dim=1)
    reused = []
    for seed in (1, 13, 1):
        check(ids, seed, store)
        reused.append(hits.last())
    assert reused[1:] == [0, ids.shape[1] - 1]
    assert not store.stats().fallbacks, store.stats().fallbacks


def test_the_same_ids_without_the_image_reuse_nothing(store: PrefixCache) -> None:
    """A text-only call (no patches, no mask) over the same ids embeds them as text: it shares nothing with the image's."""
    hits = Hits(store)
    ids = torch.cat([head(), text(6, 2)], dim=1)
    check(ids, 1, store)
    check(ids, None, store)
    assert hits.last() == 0


def test_a_mask_that_is_not_the_processors_runs_cold(store: PrefixCache) -> None:
    """Segment embeddings follow the mask: one the key cannot vouch for runs cold, counted."""
    ids = torch.cat([head(), text(6, 2)], dim=1)
    mask = media_kwargs(ids, 1)["image_embeds_position_mask"].clone()
    mask[0, -1] = -1  # a text position in the image segment
    check(ids, 1, store, image_embeds_position_mask=mask)
    assert store.stats().fallbacks == {"media_placeholders": 1}
