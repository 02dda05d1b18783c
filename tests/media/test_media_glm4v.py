"""The GLM-4V family (GLM-4.1V, GLM-4.5V, GLM-4.6V, GLM-GA, GLM-OCR) and PaddleOCR-VL through the store equal cold runs.

These M-RoPE models (their stale-`rope_deltas` and text-only cases run with the Qwen2-VL family's in
`test_media_exactness.py`) get explicit positions of the whole prompt (`get_rope_index` over all
grids), and only the media of the uncached suffix. Every request runs cold and through the
store (`assert_same_as_cold`: equal tokens, logits within 1e-4); hits are counted in
`stats().hit_tokens`, and the vision tower's work by the patch rows of the grids it is given.
GLM-4V videos (`glm4v/video`) are frames of image placeholders between video start and end ids,
marked 2 in `mm_token_type_ids`; the model cannot take images and videos in one prompt.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import Hits, assert_same_as_cold, generate
from hypothesis import HealthCheck, given, settings

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.media.families import GLM, GLM_VIDEO, NEW, SPECIAL_IDS, Family
from hf_prefix_cache.testing.media.harness import served
from hf_prefix_cache.testing.tiny_vlm_media import glm_marks, glm_video_tokens, qwen_pixels, run, text
from hf_prefix_cache.testing.tiny_vlm_parts import IMAGE_ID
from media.conftest import family_fixture
from media.test_media_property import _converse, requests

SERVED = (*GLM, "paddleocr_vl")
MEDIA = (*SERVED, GLM_VIDEO)


family = family_fixture(Family, MEDIA)


def _framing(fam: Family) -> int:
    """Text ids before a medium's first placeholder: begin-of-image (and a video's start id)."""
    return 2 if fam.name == GLM_VIDEO else 1


def tower_rows(fam: Family, ids: torch.Tensor, media: list[Any], store: PrefixCache) -> int:
    """Run through `store` only; return how many patch rows the vision tower encoded."""
    seen: list[int] = []

    def record(_module: Any, _args: tuple[Any, ...], kwargs: dict[str, Any], _out: Any) -> None:
        seen.append(int(kwargs["grid_thw"].prod(-1).sum()))

    handle = fam.model.model.visual.register_forward_hook(record, with_kwargs=True)
    try:
        generate(fam.model, ids, NEW, past_key_values=store, **fam.kwargs(ids, media))
    finally:
        handle.remove()
    return sum(seen)


def _rows(medium: Any) -> int:
    return int(medium[1].prod())


def test_second_medium_in_the_suffix(family: tuple[Family, PrefixCache]) -> None:
    """A prompt adding a second medium after a cached first one reuses the first and encodes only the second."""
    fam, store = family
    hits = Hits(store)
    first, second = fam.image(1), fam.image(2)
    prefix = torch.cat([text(5, 1), fam.placeholders(first), text(6, 2)], dim=1)
    fam.check(prefix, [first], store)
    assert hits.last() == 0
    ids = torch.cat([prefix, run(99, 1), text(4, 3), fam.placeholders(second), text(3, 4)], dim=1)
    fam.check(ids, [first, second], store)
    assert hits.last() == prefix.shape[1]
    store.clear()
    fam.check(prefix, [first], store)
    assert tower_rows(fam, ids, [first, second], store) == _rows(second)


def test_changed_medium_at_the_same_position(family: tuple[Family, PrefixCache]) -> None:
    """Identical token ids with another first medium reuse nothing past that medium's start."""
    fam, store = family
    hits = Hits(store)
    first, other, second = fam.image(1), fam.image(13), fam.image(2)  # seeds 1 and 13: same grid, other pixels
    head = text(5, 1)
    ids = torch.cat([head, fam.placeholders(first), text(6, 2), fam.placeholders(second), text(3, 4)], dim=1)
    assert torch.equal(fam.placeholders(first), fam.placeholders(other))
    fam.check(ids, [first, second], store)
    fam.check(ids, [other, second], store)
    assert hits.last() == head.shape[1] + _framing(fam)
    fam.check(ids, [first, second], store)
    assert hits.last() == ids.shape[1] - 1


def test_exact_repeat(family: tuple[Family, PrefixCache]) -> None:
    """Repeating a two-medium prompt reuses all but the last token and runs no vision tower."""
    fam, store = family
    hits = Hits(store)
    first, second = fam.image(1), fam.image(2)
    ids = torch.cat([text(3, 1), fam.placeholders(first), text(2, 2), fam.placeholders(second), text(4, 3)], dim=1)
    fam.check(ids, [first, second], store)
    fam.check(ids, [first, second], store)
    assert hits.last() == ids.shape[1] - 1
    assert tower_rows(fam, ids, [first, second], store) == 0


def test_follow_up_text_turn_reuses_the_medium_without_the_tower(family: tuple[Family, PrefixCache]) -> None:
    """A text turn after a turn with a medium reuses the whole previous turn and never runs the vision tower."""
    fam, store = family
    hits = Hits(store)
    medium = fam.image(1)
    turn = torch.cat([text(4, 10), fam.placeholders(medium), text(5, 11)], dim=1)
    out = fam.check(turn, [medium], store)
    follow = torch.cat([out.sequences, text(6, 12)], dim=1)
    fam.check(follow, [medium], store)
    assert hits.last() == out.sequences.shape[1] - 1
    store.clear()
    fam.check(turn, [medium], store)
    assert tower_rows(fam, follow, [medium], store) == 0


def test_prompt_ending_inside_a_medium_never_cuts_inside_it(family: tuple[Family, PrefixCache]) -> None:
    """When the token kept for logits is a placeholder, the reuse stops at that medium's start."""
    fam, store = family
    hits = Hits(store)
    first, second = fam.image(1), fam.image(2)
    head = torch.cat([text(3, 1), fam.placeholders(first), text(2, 2)], dim=1)
    tail = fam.placeholders(second)
    last = int((tail[0] == IMAGE_ID).nonzero()[-1])
    ids = torch.cat([head, tail[:, : last + 1]], dim=1)  # ends on the last placeholder
    fam.check(ids, [first, second], store)
    fam.check(ids, [first, second], store)
    assert hits.last() == head.shape[1] + _framing(fam)


@pytest.mark.parametrize("name", GLM)
def test_video_after_a_cached_video_and_a_changed_video(name: str) -> None:
    """GLM videos: a second video after a cached one is the only one encoded; another video of the same
    grid at the same place reuses up to its video start and begin-of-image ids."""
    fam = Family(name)
    with served(fam.model, clean=False) as store:
        hits = Hits(store)
        v1, v2, v3 = qwen_pixels(5, (2, 4, 4)), qwen_pixels(6, (3, 2, 4)), qwen_pixels(7, (3, 2, 4))
        head = torch.cat([text(4, 1), glm_video_tokens(v1[1]), text(3, 2)], dim=1)
        ids = torch.cat([head, glm_video_tokens(v2[1], first_second=2), text(3, 3)], dim=1)
        for videos, expected in (([v1], 0), ([v1, v2], head.shape[1]), ([v1, v3], head.shape[1] + 2)):
            prompt = head if len(videos) == 1 else ids
            kwargs = {
                "pixel_values_videos": torch.cat([rows for rows, _ in videos]),
                "video_grid_thw": torch.cat([grid for _, grid in videos]),
                "mm_token_type_ids": glm_marks(prompt),
            }
            assert_same_as_cold(fam.model, prompt, store, new=NEW, suppress_tokens=SPECIAL_IDS, **kwargs)
            assert hits.last() == expected
        assert not store.stats().fallbacks


@pytest.mark.parametrize("name", GLM)
def test_images_and_videos_in_one_prompt_run_cold(name: str) -> None:
    """GLM-4V fills every image placeholder with image and video features alike, so a prompt with both
    fails cold; through the store it runs cold too (`images_and_videos`) and fails the same way."""
    fam = Family(name)
    with served(fam.model, clean=False) as store:
        image, video = fam.image(1), qwen_pixels(5, (2, 4, 4))
        head = torch.cat([text(4, 1), fam.placeholders(image), text(3, 2)], dim=1)
        fam.check(head, [image], store)
        ids = torch.cat([head, glm_video_tokens(video[1]), text(3, 3)], dim=1)
        kwargs = {
            **fam.kwargs(ids, [image]),
            "pixel_values_videos": video[0],
            "video_grid_thw": video[1],
            "mm_token_type_ids": glm_marks(ids),
        }
        with pytest.raises(ValueError, match="Image features and image tokens do not match"):
            generate(fam.model, ids, NEW, **kwargs)
        with pytest.raises(ValueError, match="Image features and image tokens do not match"):
            generate(fam.model, ids, NEW, past_key_values=store, **kwargs)
        assert store.stats().fallbacks == {"images_and_videos": 1}
        assert store.stats().hit_tokens == 0


@pytest.mark.parametrize("name", [*SERVED, GLM_VIDEO])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversation=requests)
def test_random_conversations_reuse_exactly_what_the_rules_allow(name: str, conversation: list[Any]) -> None:
    """Random conversations of text and media equal their cold runs and reuse what the reference predicts."""
    _converse(name, conversation, pressure=False)
