"""Ovis2's images (`multimodal/ovis2.py`) are served exactly, their visual-indicator ids inside each item.

Every request runs cold and through the store: equal tokens, logits within 1e-4, all images
passed every time as the processor would. Indicator ids take vision embeddings only in calls
with pixels, so an item spans its indicators (a turn adding an image reuses them, a changed image
reuses the text before them: the family suite's cases, its `ovis2` row), and indicators outside an
image run cold.
"""

from __future__ import annotations

import torch
from conftest import Hits

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.multimodal.ovis2 import Ovis2Media
from hf_prefix_cache.testing.media.harness import check
from hf_prefix_cache.testing.media.ovis2 import END, Image, media_kwargs, placeholders, tiny_ovis2
from hf_prefix_cache.testing.tiny_vlm_media import text
from media.conftest import store_fixture

store = store_fixture(tiny_ovis2, no_fallbacks=False)


def test_ovis2_gets_its_adapter() -> None:
    assert isinstance(media_adapter_for(tiny_ovis2()), Ovis2Media)


def test_an_indicator_outside_an_image_runs_cold(store: PrefixCache) -> None:
    """A stray indicator id in the text is embedded from the vision table whenever pixels come: not keyable."""
    hits = Hits(store)
    ids = torch.cat([text(4, 7), torch.tensor([[END]]), text(2, 3), placeholders(Image(1)), text(5, 2)], dim=1)
    check(tiny_ovis2(), ids, store, media_kwargs([Image(1)]))
    check(tiny_ovis2(), ids, store, media_kwargs([Image(1)]))
    assert hits.last() == 0
    assert store.stats().fallbacks == {"media_placeholders": 2}
