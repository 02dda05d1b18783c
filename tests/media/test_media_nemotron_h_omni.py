"""Nemotron-H Omni's images and audio clips (a generic-table row: ``"thw"`` images with ``(h, w)`` grids,
``"conv"`` clips) are served exactly.

Its text layers hold Mamba-2 states, so the hook prefills media prompts itself from suffix
embeddings (text embeddings with the suffix media's features over their placeholders). Every
request runs cold and through the store: equal tokens, logits within 1e-4, all media passed every
time as the processor would. Videos (on the image placeholder id, pruned by content) run cold, named.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import transformers
from conftest import Hits, assert_same_as_cold, generate
from packaging.version import Version

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.multimodal.generic import GenericMedia
from hf_prefix_cache.testing.media.nemotron_h_omni import (
    CLOSE,
    IMG,
    NEW,
    OPEN,
    SPECIAL_IDS,
    clip,
    image,
    media_kwargs,
    placeholders,
    tiny_nemotron_h_omni,
)
from hf_prefix_cache.testing.tiny_vlm_media import text


def check(ids: torch.Tensor, images: list[Any], store: PrefixCache, **extra: Any) -> Any:
    """Run `ids` cold and through `store`; assert equal tokens and logits within tolerance; return the cached run."""
    model = tiny_nemotron_h_omni()
    kwargs = {**media_kwargs(images), "suppress_tokens": SPECIAL_IDS, **extra}
    return assert_same_as_cold(model, ids, store, NEW, cache_argument="past_key_values", **kwargs)


@pytest.fixture
def store() -> Iterator[PrefixCache]:
    cache = PrefixCache(tiny_nemotron_h_omni())
    yield cache
    cache.check_integrity()
    assert not cache.stats().fallbacks, cache.stats().fallbacks
    cache.detach()


def test_the_generic_adapter_serves_it() -> None:
    assert isinstance(media_adapter_for(tiny_nemotron_h_omni()), GenericMedia)


def test_the_tower_encodes_each_image_on_its_own() -> None:
    model = tiny_nemotron_h_omni()
    images = [image(1), image(2), image(0)]
    with torch.no_grad():
        together = model.get_image_features(**media_kwargs(images)).pooler_output
        for img, features in zip(images, together, strict=True):
            (alone,) = model.get_image_features(**media_kwargs([img])).pooler_output
            torch.testing.assert_close(alone, features, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kinds", [(image, image), (image, clip), (clip, image)])
def test_second_medium_after_a_cached_turn(kinds: tuple[Any, Any], store: PrefixCache) -> None:
    """A turn adding an image or clip reuses the first turn whole, and its repeat all but the last token."""
    hits = Hits(store)
    first_medium, second_medium = kinds[0](1), kinds[1](2)
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


def test_an_audio_tower_of_other_subsampling_runs_clips_cold() -> None:
    """The clips' counts assume the checkpoints' 8x subsampling: with another, calls with clips run cold."""
    model = tiny_nemotron_h_omni()
    adapter = media_adapter_for(model)
    assert adapter is not None
    ids = torch.cat([text(3, 1), placeholders(clip(1)), text(2, 2)], dim=1)[0].tolist()
    assert adapter.layout(ids, media_kwargs([clip(1)])) is not None
    model.config.audio_config.subsampling_factor = 4
    try:
        assert adapter.layout(ids, media_kwargs([clip(1)])) is None
        assert adapter.layout(ids[:3], media_kwargs([])) is not None  # text and images are unaffected
    finally:
        model.config.audio_config.subsampling_factor = 8


def test_only_suffix_images_reach_the_tower(store: PrefixCache) -> None:
    a, b, new = image(1), image(2), image(4)
    first = torch.cat([text(3, 1), placeholders(a), text(2, 6), placeholders(b), text(3, 2)], dim=1)
    check(first, [a, b], store)
    second = torch.cat([first, text(2, 4), placeholders(new), text(2, 5)], dim=1)
    seen: list[list[list[int]]] = []

    def record(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.append(kwargs["image_grid_hw"].tolist())

    handle = tiny_nemotron_h_omni().vision_model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        check(second, [a, b, new], store)
    finally:
        handle.remove()
    assert seen == [[list(a.grid), list(b.grid), list(new.grid)], [list(new.grid)]]


@pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.24"),
    reason="transformers 5.23's Nemotron-H Omni cannot generate with videos at all: its forward concatenates the "
    "video features' one tensor as if it were a tuple (TypeError), with or without a store",
)
def test_videos_run_cold_named() -> None:
    """Videos share the image placeholder id (and may be pruned by content): calls with them run cold, named."""
    model = tiny_nemotron_h_omni()
    cache = PrefixCache(model)
    # One video's frames (the form both releases take): 2 frames of 8x8 pixels, one tubelet of 2x2 patches.
    frames = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    ids = torch.cat([text(4, 1), torch.tensor([[OPEN, IMG, CLOSE]]), text(3, 2)], dim=1)
    try:
        for _ in range(2):
            cold = generate(model, ids, NEW, pixel_values_videos=frames, suppress_tokens=SPECIAL_IDS)
            warm = generate(
                model, ids, NEW, pixel_values_videos=frames, past_key_values=cache, suppress_tokens=SPECIAL_IDS
            )
            assert torch.equal(cold.sequences, warm.sequences)
        assert cache.stats().fallbacks == {"media_inputs:pixel_values_videos": 2}
    finally:
        cache.detach()
