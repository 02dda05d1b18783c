"""GraniteDocling, Granite 4 Vision and DeepSeek-OCR 2 media are served exactly, item by item.

Every request runs cold and through the store: equal tokens, logits within 1e-4, all media passed
every time as the processor would. The family suite (`test_media_families.py`) runs their turn and
changed-medium cases; here, what each family does besides: GraniteDocling's fine connector path
(its own placeholders and features, keyed apart from the coarse path's), images whose placeholders
form one run (told apart by their counts), and a DeepSeek-OCR 2 suffix whose pages have no crops.
"""

from __future__ import annotations

import pytest
import torch
from conftest import Hits

from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.multimodal.deepseek_ocr2 import DeepseekOcr2Media
from hf_prefix_cache.multimodal.idefics import GraniteDoclingMedia
from hf_prefix_cache.multimodal.llava_next import Granite4VisionMedia
from hf_prefix_cache.testing.media import deepseek_ocr2, granite4_vision, granite_docling
from hf_prefix_cache.testing.media.harness import check, same_tokens_twice, served
from hf_prefix_cache.testing.tiny_vlm_media import text


def test_each_family_gets_its_adapter() -> None:
    assert isinstance(media_adapter_for(granite_docling.tiny_granite_docling()), GraniteDoclingMedia)
    assert isinstance(media_adapter_for(granite4_vision.tiny_granite4_vision()), Granite4VisionMedia)
    assert isinstance(media_adapter_for(deepseek_ocr2.tiny_deepseek_ocr2()), DeepseekOcr2Media)


def test_granite_docling_fine_route_is_served_and_keyed_apart_from_the_coarse_route() -> None:
    """A page on the fine path reuses only the text and framing before it after the same page on the coarse path."""
    fam = granite_docling
    model = fam.tiny_granite_docling()
    coarse, fine = fam.Page(2), fam.Page(2, fine=True)
    head = text(4, 7)
    with served(model) as store:
        hits = Hits(store)
        check(model, torch.cat([head, fam.placeholders(coarse), text(5, 2)], dim=1), store, fam.media_kwargs([coarse]))
        ids = torch.cat([head, fam.placeholders(fine), text(5, 2)], dim=1)
        check(model, ids, store, fam.media_kwargs([fine]))
        assert hits.last() == head.shape[1] + 2  # the first tile's fake-image id and row/column marker
        answer = check(model, ids, store, fam.media_kwargs([fine])).sequences
        assert hits.last() == ids.shape[1] - 1
        # A later turn adds another page, on the fine path too (the route is one per call).
        more = fam.Page(4, fine=True)
        second = torch.cat([answer, text(3, 3), fam.placeholders(more), text(2, 4)], dim=1)
        check(model, second, store, fam.media_kwargs([fine, more]))
        assert hits.last() == answer.shape[1] - 1


def test_granite_docling_padding_tiles_run_cold() -> None:
    """A tile the mask marks as batch padding is dropped by the model: such a call is not keyed."""
    fam = granite_docling
    model = fam.tiny_granite_docling()
    page = fam.Page(1)
    ids = torch.cat([text(4, 7), fam.placeholders(page), text(5, 2)], dim=1)
    kwargs = fam.media_kwargs([page])
    kwargs["pixel_values"] = torch.cat([kwargs["pixel_values"], torch.zeros_like(kwargs["pixel_values"])], dim=1)
    kwargs["pixel_attention_mask"] = torch.tensor([[True, False]])
    with served(model, clean=False) as store:
        same_tokens_twice(model, ids, store, **kwargs)
        assert store.stats().hit_tokens == 0
        assert store.stats().fallbacks == {"media_placeholders": 2}


@pytest.mark.parametrize("family", ["granite4_vision", "deepseek_ocr2"])
def test_images_in_one_placeholder_run_are_told_apart(family: str) -> None:
    """Two images with nothing between them: a changed second image reuses the first one whole."""
    fam = {"granite4_vision": granite4_vision, "deepseek_ocr2": deepseek_ocr2}[family]
    model = fam.tiny_granite4_vision() if fam is granite4_vision else fam.tiny_deepseek_ocr2()
    build = fam.Image if fam is granite4_vision else fam.Page
    first, second, other = build(1), build(2), build(5)  # seeds 2 and 5: one size, other pixels
    head = text(4, 7)
    with served(model) as store:
        hits = Hits(store)
        for images in ([first, second], [first, other]):
            ids = torch.cat([head, *(fam.placeholders(i) for i in images), text(5, 2)], dim=1)
            check(model, ids, store, fam.media_kwargs(images))
        assert hits.last() == head.shape[1] + fam.placeholders(first).shape[1]


def test_deepseek_ocr2_suffix_of_pages_without_crops() -> None:
    """A turn adding a page without crops reuses the previous turn; its suffix passes no local views."""
    fam = deepseek_ocr2
    model = fam.tiny_deepseek_ocr2()
    page, bare = fam.Page(1), fam.Page(3)
    assert bare.views()[1].shape[0] == 0
    with served(model) as store:
        hits = Hits(store)
        ids = torch.cat([text(4, 7), fam.placeholders(page), text(5, 2)], dim=1)
        answer = check(model, ids, store, fam.media_kwargs([page])).sequences
        second = torch.cat([answer, text(3, 3), fam.placeholders(bare), text(2, 4)], dim=1)
        check(model, second, store, fam.media_kwargs([page, bare]))
        assert hits.last() == answer.shape[1] - 1
        check(model, second, store, fam.media_kwargs([page, bare]))
        assert hits.last() == second.shape[1] - 1
