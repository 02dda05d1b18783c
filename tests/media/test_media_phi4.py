"""Phi-4-multimodal serves images and audio clips exactly, keyed by content.

Every request runs cold and through the store: equal tokens, logits within 1e-4. A clip's
projection depends on whether its call passes an image, so prompts with both kinds are a
scope of their own, and a resumed call with a clip but no new image still passes an image.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import Hits

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.multimodal.phi4 import Phi4MultimodalMedia
from hf_prefix_cache.testing.media import harness
from hf_prefix_cache.testing.media.phi4 import Medium, cached_phi4, clip, image, kwargs, placeholders
from hf_prefix_cache.testing.tiny_vlm_media import text
from media.conftest import store_fixture

store = store_fixture(cached_phi4)


def check(ids: torch.Tensor, media: list[Medium], store: PrefixCache) -> Any:
    return harness.check(cached_phi4(), ids, store, kwargs(media))


def test_phi4_multimodal_gets_its_adapter() -> None:
    assert type(media_adapter_for(cached_phi4())) is Phi4MultimodalMedia


def test_images_then_a_clip_then_another_clip(store: PrefixCache) -> None:
    """Image turns reuse each other; a clip joins a scope of its own; a later clip reuses the clip turn whole."""
    hits = Hits(store)
    one, two, first_clip, second_clip = image(1), image(2), clip(1), clip(2)
    first = torch.cat([text(5, 1), placeholders(one), text(6, 2)], dim=1)
    answer = check(first, [one], store).sequences
    second = torch.cat([answer, text(3, 3), placeholders(two), text(3, 4)], dim=1)
    check(second, [one, two], store)
    assert hits.last() == answer.shape[1] - 1
    third = torch.cat([second, placeholders(first_clip), text(3, 5)], dim=1)
    answer = check(third, [one, two, first_clip], store).sequences
    assert hits.last() == 0  # the first prompt with a clip and an image: another projection, another scope
    fourth = torch.cat([answer, text(2, 7), placeholders(second_clip), text(2, 8)], dim=1)
    check(fourth, [one, two, first_clip, second_clip], store)  # the suffix's clip needs an image passed
    assert hits.last() == answer.shape[1] - 1
    check(fourth, [one, two, first_clip, second_clip], store)
    assert hits.last() == fourth.shape[1] - 1


def test_a_clip_turn_then_an_image_turn(store: PrefixCache) -> None:
    """A clip-only prompt's states are not reused once an image joins its prompt (the projection changes)."""
    hits = Hits(store)
    head = text(4, 9)
    first = torch.cat([head, placeholders(clip(1)), text(3, 2)], dim=1)
    answer = check(first, [clip(1)], store).sequences
    second = torch.cat([answer, text(2, 3), placeholders(image(1)), text(2, 4)], dim=1)
    check(second, [clip(1), image(1)], store)
    assert hits.last() == 0
    check(second, [clip(1), image(1)], store)
    assert hits.last() == second.shape[1] - 1


@pytest.mark.parametrize("build", [image, clip])
def test_changed_medium_reuses_nothing_past_its_first_placeholder(build: Any, store: PrefixCache) -> None:
    """Identical ids with another image or clip reuse only the text before it."""
    hits = Hits(store)
    head = text(5, 1)
    ids = torch.cat([head, placeholders(build(1)), text(6, 2)], dim=1)
    check(ids, [build(1)], store)
    check(ids, [build(13)], store)
    assert hits.last() == head.shape[1]
    check(ids, [build(1)], store)
    assert hits.last() == ids.shape[1] - 1
