"""Emu3's images (VQ code grids embedded as text, `multimodal/emu3.py`) are served exactly.

Every request runs cold and through the store: equal tokens, logits within 1e-4, all images
passed every time as the processor would. An image is keyed with the padding its prompt gives
it, since the VQ encoder reads that padding. A turn adding an image and a changed image are the
family suite's cases (`test_media_families.py`, its `emu3` row).
"""

from __future__ import annotations

import torch
from conftest import Hits

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.multimodal.emu3 import Emu3Media
from hf_prefix_cache.testing.media.emu3 import IMG, Image, media_kwargs, placeholders, tiny_emu3
from hf_prefix_cache.testing.media.harness import check
from hf_prefix_cache.testing.tiny_vlm_media import text
from media.conftest import store_fixture

store = store_fixture(tiny_emu3)


def test_emu3_gets_its_adapter() -> None:
    assert isinstance(media_adapter_for(tiny_emu3()), Emu3Media)


def test_padding_changes_an_images_codes() -> None:
    """Why an item is its padded row: the same picture padded to a larger one's size gets other codes."""
    model, small, large = tiny_emu3(), Image(1), Image(2)
    with torch.no_grad():
        alone = model.model.get_image_tokens(**media_kwargs([small]))
        padded = model.model.get_image_tokens(**media_kwargs([small, large]))[: alone.shape[0]]
    assert not torch.equal(alone, padded)


def test_a_larger_later_image_re_pads_the_first_and_reuse_stops_there(store: PrefixCache) -> None:
    """A second image larger than the first pads it anew: reuse stops before its placeholders, and stays exact."""
    hits = Hits(store)
    model, small, large = tiny_emu3(), Image(1), Image(2)
    first = torch.cat([text(5, 1), placeholders(small), text(6, 2)], dim=1)
    answer = check(model, first, store, media_kwargs([small])).sequences
    second = torch.cat([answer, text(4, 3), placeholders(large), text(3, 4)], dim=1)
    check(model, second, store, media_kwargs([small, large]))
    assert hits.last() == int((first[0] == IMG).nonzero()[0])
