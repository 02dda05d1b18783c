"""Emu3's images (VQ code grids embedded as text, `multimodal/emu3.py`) are served exactly.

Every request runs cold and through the store: equal tokens, logits within 1e-4, all images
passed every time as the processor would. An image is keyed with the padding its prompt gives
it, since the VQ encoder reads that padding.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import Hits, assert_same_as_cold

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.multimodal.emu3 import Emu3Media
from hf_prefix_cache.testing.media.emu3 import (
    IMG,
    NEW,
    SPECIAL_IDS,
    Image,
    media_kwargs,
    placeholders,
    tiny_emu3,
)
from hf_prefix_cache.testing.tiny_vlm_media import text


def check(ids: torch.Tensor, images: list[Image], store: PrefixCache) -> Any:
    """Run `ids` cold and through `store`; assert equal tokens and logits within tolerance; return the cached run."""
    kwargs = {**media_kwargs(images), "suppress_tokens": SPECIAL_IDS}
    return assert_same_as_cold(tiny_emu3(), ids, store, NEW, cache_argument="past_key_values", **kwargs)


@pytest.fixture
def store() -> Iterator[PrefixCache]:
    cache = PrefixCache(tiny_emu3())
    yield cache
    cache.check_integrity()
    assert not cache.stats().fallbacks, cache.stats().fallbacks
    cache.detach()


def test_emu3_gets_its_adapter() -> None:
    assert isinstance(media_adapter_for(tiny_emu3()), Emu3Media)


def test_padding_changes_an_images_codes() -> None:
    """Why an item is its padded row: the same picture padded to a larger one's size gets other codes."""
    model, small, large = tiny_emu3(), Image(1), Image(2)
    with torch.no_grad():
        alone = model.model.get_image_tokens(**media_kwargs([small]))
        padded = model.model.get_image_tokens(**media_kwargs([small, large]))[: alone.shape[0]]
    assert not torch.equal(alone, padded)


def test_second_image_after_a_cached_turn(store: PrefixCache) -> None:
    """A turn adding an image of the same size reuses the first turn whole, and its repeat all but the last token."""
    hits = Hits(store)
    first_image, second_image = Image(1), Image(4)  # seeds 1 and 4: one size, other pixels
    first = torch.cat([text(5, 1), placeholders(first_image), text(6, 2)], dim=1)
    answer = check(first, [first_image], store).sequences
    second = torch.cat([answer, text(4, 3), placeholders(second_image), text(3, 4)], dim=1)
    check(second, [first_image, second_image], store)
    assert hits.last() == answer.shape[1] - 1
    check(second, [first_image, second_image], store)
    assert hits.last() == second.shape[1] - 1


def test_a_larger_later_image_re_pads_the_first_and_reuse_stops_there(store: PrefixCache) -> None:
    """A second image larger than the first pads it anew: reuse stops before its placeholders, and stays exact."""
    hits = Hits(store)
    small, large = Image(1), Image(2)
    head = text(5, 1)
    first = torch.cat([head, placeholders(small), text(6, 2)], dim=1)
    answer = check(first, [small], store).sequences
    second = torch.cat([answer, text(4, 3), placeholders(large), text(3, 4)], dim=1)
    check(second, [small, large], store)
    assert hits.last() == int((first[0] == IMG).nonzero()[0])


def test_changed_image_reuses_nothing_past_its_first_placeholder(store: PrefixCache) -> None:
    """Identical ids with another image reuse the text and framing before its placeholders, no more."""
    hits = Hits(store)
    head = text(4, 7)
    ids = torch.cat([head, placeholders(Image(1)), text(5, 2)], dim=1)
    check(ids, [Image(1)], store)
    check(ids, [Image(13)], store)
    assert hits.last() == head.shape[1] + 2
    check(ids, [Image(1)], store)
    assert hits.last() == ids.shape[1] - 1
