"""Ovis2's images (`multimodal/ovis2.py`) are served exactly, their visual-indicator ids inside each item.

Every request runs cold and through the store: equal tokens, logits within 1e-4, all images
passed every time as the processor would. Indicator ids take vision embeddings only in calls
with pixels, so an item spans its indicators, and indicators outside an image run cold.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import Hits, assert_same_as_cold

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.multimodal.ovis2 import Ovis2Media
from hf_prefix_cache.testing.media.ovis2 import (
    END,
    NEW,
    SPECIAL_IDS,
    Image,
    media_kwargs,
    placeholders,
    tiny_ovis2,
)
from hf_prefix_cache.testing.tiny_vlm_media import text


def check(ids: torch.Tensor, images: list[Image], store: PrefixCache) -> Any:
    """Run `ids` cold and through `store`; assert equal tokens and logits within tolerance; return the cached run."""
    kwargs = {**media_kwargs(images), "suppress_tokens": SPECIAL_IDS}
    return assert_same_as_cold(tiny_ovis2(), ids, store, NEW, cache_argument="past_key_values", **kwargs)


@pytest.fixture
def store() -> Iterator[PrefixCache]:
    cache = PrefixCache(tiny_ovis2())
    yield cache
    cache.check_integrity()
    cache.detach()


def test_ovis2_gets_its_adapter() -> None:
    assert isinstance(media_adapter_for(tiny_ovis2()), Ovis2Media)


@pytest.mark.parametrize("seeds", [(1, 2), (2, 4)], ids=["global-then-tiled", "tiled-then-global"])
def test_second_image_after_a_cached_turn(seeds: tuple[int, int], store: PrefixCache) -> None:
    """A turn adding an image reuses the first turn whole (its indicators too), and its repeat all but the last token."""
    hits = Hits(store)
    first_image, second_image = Image(seeds[0]), Image(seeds[1])
    first = torch.cat([text(5, 1), placeholders(first_image), text(6, 2)], dim=1)
    answer = check(first, [first_image], store).sequences
    second = torch.cat([answer, text(4, 3), placeholders(second_image), text(3, 4)], dim=1)
    check(second, [first_image, second_image], store)
    assert hits.last() == answer.shape[1] - 1
    check(second, [first_image, second_image], store)
    assert hits.last() == second.shape[1] - 1
    assert not store.stats().fallbacks, store.stats().fallbacks


def test_changed_image_reuses_nothing_past_its_start_indicator(store: PrefixCache) -> None:
    """Identical ids with another image reuse the text before its stretch, no more."""
    hits = Hits(store)
    head = text(4, 7)
    ids = torch.cat([head, placeholders(Image(1)), text(5, 2)], dim=1)
    check(ids, [Image(1)], store)
    check(ids, [Image(13)], store)
    assert hits.last() == head.shape[1]
    check(ids, [Image(1)], store)
    assert hits.last() == ids.shape[1] - 1
    assert not store.stats().fallbacks, store.stats().fallbacks


def test_an_indicator_outside_an_image_runs_cold(store: PrefixCache) -> None:
    """A stray indicator id in the text is embedded from the vision table whenever pixels come: not keyable."""
    hits = Hits(store)
    ids = torch.cat([text(4, 7), torch.tensor([[END]]), text(2, 3), placeholders(Image(1)), text(5, 2)], dim=1)
    check(ids, [Image(1)], store)
    check(ids, [Image(1)], store)
    assert hits.last() == 0
    assert store.stats().fallbacks == {"media_placeholders": 2}
