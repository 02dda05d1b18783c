"""The generic table's ``"thw"`` families (flattened patch rows keyed by a grid) serve images and videos exactly.

Every request runs cold and through the store: equal tokens, logits within 1e-4, all media
passed every time as the processor would.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import Hits, assert_same_as_cold, generate

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.multimodal.generic import GenericMedia
from hf_prefix_cache.testing.media.grid import FAMILIES, STATE_FAMILIES, GridFamily, Medium
from hf_prefix_cache.testing.tiny_vlm_media import text

NEW = 4
SPECIAL_IDS = list(range(100, 128))


def check(fam: GridFamily, ids: torch.Tensor, media: list[Medium], store: PrefixCache) -> Any:
    """Run `ids` cold and through `store` (`assert_same_as_cold`); return the cached run."""
    kwargs = {**fam.kwargs(ids, media), "suppress_tokens": SPECIAL_IDS}
    return assert_same_as_cold(fam.model, ids, store, NEW, cache_argument="past_key_values", **kwargs)


@pytest.fixture(params=FAMILIES)
def family(request: pytest.FixtureRequest) -> Iterator[tuple[GridFamily, PrefixCache]]:
    fam = GridFamily(request.param)
    store = PrefixCache(fam.model)
    yield fam, store
    store.check_integrity()
    assert not store.stats().fallbacks, store.stats().fallbacks
    store.detach()


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


def test_image_and_video_after_a_cached_image(family: tuple[GridFamily, PrefixCache]) -> None:
    """A turn adding an image and a video reuses the first turn whole, and its repeat all but the last token."""
    fam, store = family
    hits = Hits(store)
    first_image, image, video = fam.image(1), fam.image(2), fam.video(5)
    first = torch.cat([text(5, 1), fam.placeholders(first_image), text(6, 2)], dim=1)
    answer = check(fam, first, [first_image], store).sequences
    second = torch.cat(
        [answer, text(4, 3), fam.placeholders(image), text(3, 4), fam.placeholders(video), text(3, 5)], dim=1
    )
    check(fam, second, [first_image, image, video], store)
    assert hits.last() == answer.shape[1] - 1
    check(fam, second, [first_image, image, video], store)
    assert hits.last() == second.shape[1] - 1


def test_changed_medium_reuses_nothing_past_its_first_placeholder(family: tuple[GridFamily, PrefixCache]) -> None:
    """Identical ids with another image or video reuse at most the text and framing before its placeholders.

    A family with states restores only at a snapshot: the divergence from the first request's
    prefix is one once a second request has stopped there.
    """
    fam, store = family
    hits = Hits(store)
    for build in (fam.image, fam.video):
        store.clear()
        one, other, third = build(1), build(13), build(25)  # seeds 1, 13, 25: same grid, other content
        head = text(4, 7)
        ids = torch.cat([head, fam.placeholders(one), text(5, 2)], dim=1)
        start = head.shape[1] + 1  # the framing id before the first placeholder is text
        check(fam, ids, [one], store)
        check(fam, ids, [other], store)
        assert hits.last() == (0 if fam.name in STATE_FAMILIES else start)
        check(fam, ids, [third], store)
        assert hits.last() == start, build.__name__


def test_only_suffix_media_reach_the_tower(family: tuple[GridFamily, PrefixCache]) -> None:
    """After a cached image and video, the tower encodes only the new image's patch rows."""
    fam, store = family
    old, video, new = fam.image(1), fam.video(2), fam.image(2)
    first = torch.cat([text(3, 1), fam.placeholders(old), text(2, 6), fam.placeholders(video), text(3, 2)], dim=1)
    check(fam, first, [old, video], store)
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
    store = PrefixCache(fam.model)
    try:
        video = fam.video(1)
        ids = torch.cat([text(4, 1), fam.placeholders(video), text(3, 2)], dim=1)
        kwargs = fam.kwargs(ids, [video])
        kwargs["video_compression_mask"] = torch.ones(fam.count(video), dtype=torch.bool)
        for _ in range(2):
            cold = generate(fam.model, ids, NEW, suppress_tokens=SPECIAL_IDS, **kwargs)
            warm = generate(fam.model, ids, NEW, past_key_values=store, suppress_tokens=SPECIAL_IDS, **kwargs)
            assert torch.equal(cold.sequences, warm.sequences)
        assert store.stats().hit_tokens == 0
        assert store.stats().fallbacks == {"media_inputs:video_compression_mask": 2}
    finally:
        store.detach()
