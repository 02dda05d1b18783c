"""Inkling's images and audio clips (a generic-table row with suffix embeddings) are served exactly.

Its vision tower encodes each patch row on its own into one placeholder (so every patch is an
item), and an audio clip is a row of dMel bin ids with one placeholder per valid frame. Its
hybrid text layers hold conv states, so the hook prefills media prompts itself from suffix
embeddings. Every request runs cold and through the store: equal tokens, logits within 1e-4, all
media passed every time as the processor would.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import Hits, assert_same_as_cold

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.multimodal.generic import GenericMedia
from hf_prefix_cache.testing.media.inkling import (
    NEW,
    SPECIAL_IDS,
    Medium,
    clip,
    image,
    media_kwargs,
    placeholders,
    tiny_inkling,
)
from hf_prefix_cache.testing.tiny_vlm_media import text


def check(ids: torch.Tensor, media: list[Medium], store: PrefixCache) -> Any:
    """Run `ids` cold and through `store`; assert equal tokens and logits within tolerance; return the cached run."""
    model = tiny_inkling()
    kwargs = {**media_kwargs(media), "suppress_tokens": SPECIAL_IDS}
    return assert_same_as_cold(model, ids, store, NEW, cache_argument="past_key_values", **kwargs)


@pytest.fixture
def store() -> Iterator[PrefixCache]:
    cache = PrefixCache(tiny_inkling())
    yield cache
    cache.check_integrity()
    assert not cache.stats().fallbacks, cache.stats().fallbacks
    cache.detach()


def test_the_generic_adapter_serves_it() -> None:
    assert isinstance(media_adapter_for(tiny_inkling()), GenericMedia)


def test_the_tower_encodes_each_patch_on_its_own() -> None:
    model = tiny_inkling()
    rows = media_kwargs([image(1), image(2)])["pixel_values"]
    with torch.no_grad():
        together = model.model.get_image_features(rows).pooler_output
        alone = torch.cat([model.model.get_image_features(rows[i : i + 1]).pooler_output for i in range(len(rows))])
    torch.testing.assert_close(alone, together, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kinds", [("image", "image"), ("image", "audio"), ("audio", "image")])
def test_second_medium_after_a_cached_turn(kinds: tuple[str, str], store: PrefixCache) -> None:
    """A turn adding a medium reuses the first turn whole, and its repeat all but the last token."""
    hits = Hits(store)
    first_medium, second_medium = Medium(kinds[0], 1), Medium(kinds[1], 2)
    first = torch.cat([text(5, 1), placeholders(first_medium), text(6, 2)], dim=1)
    answer = check(first, [first_medium], store).sequences
    second = torch.cat([answer, text(4, 3), placeholders(second_medium), text(3, 4)], dim=1)
    check(second, [first_medium, second_medium], store)
    assert hits.last() == answer.shape[1] - 1
    check(second, [first_medium, second_medium], store)
    assert hits.last() == second.shape[1] - 1


@pytest.mark.parametrize("build", [image, clip])
def test_changed_medium_reuses_nothing_past_its_first_placeholder(build: Any, store: PrefixCache) -> None:
    """Identical ids with another image or clip reuse at most the text and framing before its placeholders
    (once a snapshot was taken there)."""
    hits = Hits(store)
    head = text(4, 7)
    ids = torch.cat([head, placeholders(build(1)), text(5, 2)], dim=1)
    check(ids, [build(1)], store)
    check(ids, [build(13)], store)
    assert hits.last() == 0
    check(ids, [build(25)], store)
    assert hits.last() == head.shape[1] + 1
