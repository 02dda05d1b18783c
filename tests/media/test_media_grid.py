"""The generic table's ``"thw"`` families (flattened patch rows keyed by a grid) serve images and videos exactly.

Every request runs cold and through the store: equal tokens, logits within 1e-4, all media
passed every time as the processor would.
"""

from __future__ import annotations

from typing import Any

import torch
from conftest import generate

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.multimodal.generic import GenericMedia
from hf_prefix_cache.testing.media import harness
from hf_prefix_cache.testing.media.grid import FAMILIES, GridFamily, Medium
from hf_prefix_cache.testing.media.harness import NEW, same_tokens_twice, served
from hf_prefix_cache.testing.tiny_vlm_media import text
from media.conftest import family_fixture

family = family_fixture(GridFamily, FAMILIES)


def test_the_generic_adapter_serves_them() -> None:
    for name in FAMILIES:
        assert isinstance(media_adapter_for(GridFamily(name).model), GenericMedia), name


def test_the_tower_encodes_each_item_on_its_own(family: tuple[GridFamily, PrefixCache]) -> None:
    """An item's features do not depend on the other items encoded with it."""
    fam, _ = family
    media = [fam.image(1), fam.image(2), fam.image(0)]
    names = ("pixel_values", "image_grid_thw", "image_merge_sizes")

    def features(batch: list[Medium]) -> Any:
        kwargs = fam.kwargs(torch.zeros(1, 1, dtype=torch.long), batch)
        return fam.model.model.get_image_features(**{n: kwargs[n] for n in names if n in kwargs}).pooler_output

    with torch.no_grad():
        for medium, together in zip(media, features(media), strict=True):
            (alone,) = features([medium])
            torch.testing.assert_close(alone, together, rtol=0, atol=1e-6)


def test_only_suffix_media_reach_the_tower(family: tuple[GridFamily, PrefixCache]) -> None:
    """After a cached image and video, the tower encodes only the new image's patch rows."""
    fam, store = family
    old, video, new = fam.image(1), fam.video(2), fam.image(2)
    first = torch.cat([text(3, 1), fam.placeholders(old), text(2, 6), fam.placeholders(video), text(3, 2)], dim=1)
    harness.check(fam.model, first, store, fam.kwargs(first, [old, video]))
    second = torch.cat([first, text(2, 4), fam.placeholders(new), text(2, 5)], dim=1)
    seen: list[int] = []

    def record(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.append(int((args[0] if args else kwargs["pixel_values"]).shape[0]))

    inner = fam.model.model
    tower = next(getattr(inner, name) for name in ("vision_tower", "vision_model", "visual") if hasattr(inner, name))
    handle = tower.register_forward_pre_hook(record, with_kwargs=True)
    try:
        generate(fam.model, second, NEW, past_key_values=store, **fam.kwargs(second, [old, video, new]))
    finally:
        handle.remove()
    assert seen == [fam.rows(new).shape[0]]


def test_video_llama_3_compressed_videos_run_cold() -> None:
    """A token-compression mask drops video features by content, outside the pattern: such calls run cold, named."""
    fam = GridFamily("video_llama_3")
    with served(fam.model, clean=False) as store:
        video = fam.video(1)
        ids = torch.cat([text(4, 1), fam.placeholders(video), text(3, 2)], dim=1)
        kwargs = fam.kwargs(ids, [video])
        kwargs["video_compression_mask"] = torch.ones(fam.count(video), dtype=torch.bool)
        same_tokens_twice(fam.model, ids, store, **kwargs)
        assert store.stats().hit_tokens == 0
        assert store.stats().fallbacks == {"media_inputs:video_compression_mask": 2}
