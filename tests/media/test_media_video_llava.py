"""Video-LLaVA with its image processor's output as it comes (`pixel_values_images`) reuses an image turn under a video turn.

The image processor returns images under the deprecated name `pixel_values_images` unless
told otherwise; the model maps it to `pixel_values`. The generic rule reads it as an alias.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import pytest
import torch
import transformers
from conftest import LOGIT_TOL, Hits, generate, max_logit_diff

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.media.generic import NEW, GenericFamily
from hf_prefix_cache.testing.media.generic_ids import SPECIAL_IDS
from hf_prefix_cache.testing.media.harness import served
from hf_prefix_cache.testing.tiny_vlm_media import pil_image, text


def _images(*seeds: int) -> torch.Tensor:
    """What `VideoLlavaImageProcessor` returns by default: images under `pixel_values_images`."""
    processor = transformers.VideoLlavaImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its deprecation notice about the legacy name
        out = processor(images=[pil_image(seed) for seed in seeds], return_tensors="pt")
    assert set(out) == {"pixel_values_images"}
    return out["pixel_values_images"]


def check(model: Any, ids: torch.Tensor, store: PrefixCache, **media: Any) -> Any:
    kwargs = {**media, "suppress_tokens": SPECIAL_IDS}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the model's notice about `pixel_values_images`
        cold = generate(model, ids, NEW, **kwargs)
        warm = generate(model, ids, NEW, past_key_values=store, **kwargs)
    assert torch.equal(cold.sequences, warm.sequences), f"tokens differ:\n{cold.sequences}\n{warm.sequences}"
    assert max_logit_diff(cold, warm) < LOGIT_TOL
    return warm


@pytest.fixture
def fam() -> GenericFamily:
    return GenericFamily("video_llava")


def test_image_then_video_reuses_the_image_turn(fam: GenericFamily) -> None:
    """A turn adding a video after an image turn reuses all of it; the repeat reuses all but the last token."""
    with served(fam.model, clean=False) as store:
        hits = Hits(store)
        image, video = fam.medium(0), fam.medium(1)
        assert image.kind == "image" and video.kind == "video"
        first = torch.cat([text(5, 1), fam.placeholders(image), text(6, 2)], dim=1)
        answer = check(fam.model, first, store, pixel_values_images=_images(0)).sequences
        second = torch.cat([answer, text(3, 3), fam.placeholders(video), text(3, 4)], dim=1)
        videos = torch.stack([video.rows[0]])
        check(fam.model, second, store, pixel_values_images=_images(0), pixel_values_videos=videos)
        assert hits.last() == answer.shape[1] - 1
        check(fam.model, second, store, pixel_values_images=_images(0), pixel_values_videos=videos)
        assert hits.last() == second.shape[1] - 1
        assert not store.stats().fallbacks, store.stats().fallbacks


def test_another_image_under_the_legacy_name_reuses_nothing_past_it(fam: GenericFamily) -> None:
    """The alias keys images by content like `pixel_values`: another picture stops reuse at its placeholders."""
    with served(fam.model, clean=False) as store:
        hits = Hits(store)
        head = text(5, 1)
        ids = torch.cat([head, fam.placeholders(fam.medium(0)), text(6, 2)], dim=1)
        check(fam.model, ids, store, pixel_values_images=_images(0))
        check(fam.model, ids, store, pixel_values_images=_images(3))
        assert hits.last() == head.shape[1]
        check(fam.model, ids, store, pixel_values=_images(0))  # the new name keys the same image the same way
        assert hits.last() == ids.shape[1] - 1


def test_both_names_at_once_run_cold(fam: GenericFamily) -> None:
    """Images under both names are two values for one input: cold, with a reason."""
    with served(fam.model, clean=False) as store:
        ids = torch.cat([text(5, 1), fam.placeholders(fam.medium(0)), text(6, 2)], dim=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            # The model itself may refuse two values; the store never answers instead.
            with contextlib.suppress(TypeError, ValueError):
                generate(
                    fam.model, ids, NEW, past_key_values=store, pixel_values=_images(0), pixel_values_images=_images(0)
                )
        assert store.stats().hit_tokens == 0 and store.stats().fallbacks
