"""Nemotron-H Omni's images and audio clips (a generic-table row: ``"thw"`` images with ``(h, w)`` grids,
``"conv"`` clips) are served exactly.

Its text layers hold Mamba-2 states, so the hook prefills media prompts itself from suffix
embeddings (text embeddings with the suffix media's features over their placeholders). Every
request runs cold and through the store: equal tokens, logits within 1e-4, all media passed every
time as the processor would. Videos (on the image placeholder id, pruned by content) run cold, named.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from packaging.version import Version

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.multimodal.generic import GenericMedia
from hf_prefix_cache.testing.media import harness
from hf_prefix_cache.testing.media.harness import same_tokens_twice, served
from hf_prefix_cache.testing.media.nemotron_h_omni import (
    CLOSE,
    IMG,
    OPEN,
    clip,
    image,
    media_kwargs,
    placeholders,
    tiny_nemotron_h_omni,
)
from hf_prefix_cache.testing.tiny_vlm_media import text
from media.conftest import store_fixture

store = store_fixture(tiny_nemotron_h_omni)


def check(ids: torch.Tensor, images: list[Any], store: PrefixCache) -> Any:
    return harness.check(tiny_nemotron_h_omni(), ids, store, media_kwargs(images))


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
    # One video's frames (the form both releases take): 2 frames of 8x8 pixels, one tubelet of 2x2 patches.
    frames = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    ids = torch.cat([text(4, 1), torch.tensor([[OPEN, IMG, CLOSE]]), text(3, 2)], dim=1)
    with served(model, clean=False) as cache:
        same_tokens_twice(model, ids, cache, pixel_values_videos=frames)
        assert cache.stats().fallbacks == {"media_inputs:pixel_values_videos": 2}
