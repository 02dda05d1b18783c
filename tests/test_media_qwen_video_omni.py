"""Qwen3-VL videos through the store equal cold runs and reuse exactly what is the same.

Every request runs cold and through the store (equal tokens, logits within 1e-4), passing all
media every time as a processor would. Hits are counted in `stats().hit_tokens`; encoder work
is counted with forward hooks on the vision and audio towers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import assert_same_as_cold, generate
from tiny_qwen_media import (
    EncoderCalls,
    Media,
    image_tokens,
    qwen3_video_tokens,
    timestamp,
)
from tiny_vlms import VISION_END_ID, cached_vlm, run, text

from hf_prefix_cache import PrefixCache

NEW = 5
# Answers never contain media or framing ids, so a later turn built from them stays a valid prompt.
SUPPRESS = list(range(100, 128))
IMAGE, SMALL_IMAGE, VIDEO = (1, 4, 6), (1, 2, 4), (2, 4, 4)


class Served:
    """A model, its store, and the prompts it has served; `hits` gives the hit tokens of the last request."""

    def __init__(self, model: Any, qwen3: bool = False) -> None:
        self.model, self.qwen3 = model, qwen3
        self.store = PrefixCache(model)
        self._seen = 0

    def kwargs(self, ids: torch.Tensor, media: Media, audio_in_video: bool = False) -> dict[str, Any]:
        return media.kwargs(ids, qwen3=self.qwen3, audio_in_video=audio_in_video)

    def check(self, ids: torch.Tensor, media: Media, audio_in_video: bool = False) -> Any:
        kwargs = {**self.kwargs(ids, media, audio_in_video), "suppress_tokens": SUPPRESS}
        return assert_same_as_cold(self.model, ids, self.store, new=NEW, **kwargs)

    def hits(self) -> int:
        now = self.store.stats().hit_tokens
        hit, self._seen = now - self._seen, now
        return hit

    def encoded(self, ids: torch.Tensor, media: Media, towers: dict[str, str], audio_in_video: bool = False) -> Any:
        """Run through the store only; what each tower saw (patch rows, or audio frames)."""
        with EncoderCalls(self.model, towers) as calls:
            generate(self.model, ids, NEW, past_key_values=self.store, **self.kwargs(ids, media, audio_in_video))
        return calls


@pytest.fixture
def qwen3() -> Iterator[Served]:
    served = Served(cached_vlm("qwen3_vl"), qwen3=True)
    yield served
    served.store.check_integrity()
    assert not served.store.stats().fallbacks, served.store.stats().fallbacks
    served.store.detach()


def cat(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts, dim=1)


# --------------------------------------------------------------------------- Qwen3-VL videos


def test_qwen3_vl_image_cached_then_video_in_the_suffix(qwen3: Served) -> None:
    """A video after a cached image reuses the image's prefix and is the only medium encoded."""
    head = cat(text(4, 1), image_tokens(IMAGE), text(3, 2))
    first = Media(images=[(1, IMAGE)])
    qwen3.check(head, first)
    ids = cat(head, run(99, 1), qwen3_video_tokens(VIDEO), text(3, 3))
    both = Media(images=[(1, IMAGE)], videos=[(5, VIDEO, 0.5)])
    qwen3.hits()
    qwen3.check(ids, both)
    assert qwen3.hits() == head.shape[1]
    qwen3.store.clear()
    qwen3.check(head, first)
    qwen3.hits()
    assert qwen3.encoded(ids, both, {"visual": "visual"}).total("visual") == 2 * 4 * 4


def test_qwen3_vl_video_cached_then_new_image(qwen3: Served) -> None:
    """An image after a cached video (all its frames and timestamps) reuses the video and encodes the image only."""
    head = cat(text(4, 1), qwen3_video_tokens(VIDEO), text(3, 2))
    first = Media(videos=[(5, VIDEO, 0.5)])
    qwen3.check(head, first)
    ids = cat(head, run(99, 1), image_tokens(IMAGE), text(3, 3))
    both = Media(images=[(1, IMAGE)], videos=[(5, VIDEO, 0.5)])
    qwen3.hits()
    qwen3.check(ids, both)
    assert qwen3.hits() == head.shape[1]
    qwen3.store.clear()
    qwen3.check(head, first)
    qwen3.hits()
    assert qwen3.encoded(ids, both, {"visual": "visual"}).total("visual") == 4 * 6


def test_qwen3_vl_changed_video_with_identical_tokens(qwen3: Served) -> None:
    """Identical ids with another video reuse nothing past the video's first frame; the first video again reuses all."""
    head = text(5, 1)
    ids = cat(head, qwen3_video_tokens(VIDEO), text(3, 2), image_tokens(IMAGE), text(3, 4))
    qwen3.check(ids, Media(images=[(1, IMAGE)], videos=[(5, VIDEO, 0.5)]))
    qwen3.hits()
    qwen3.check(ids, Media(images=[(1, IMAGE)], videos=[(6, VIDEO, 0.5)]))
    # The first frame's timestamp and vision start are text before the video's span.
    assert qwen3.hits() == head.shape[1] + timestamp(0.5).shape[1] + 1
    qwen3.check(ids, Media(images=[(1, IMAGE)], videos=[(5, VIDEO, 0.5)]))
    assert qwen3.hits() == ids.shape[1] - 1


def test_qwen3_vl_timestamps_inside_a_video_are_keyed(qwen3: Served) -> None:
    """The same frames with another timestamp between them reuse nothing past the video's start."""
    head = text(5, 1)
    video = qwen3_video_tokens(VIDEO)
    ids = cat(head, video, text(3, 2))
    media = Media(videos=[(5, VIDEO, 0.5)])
    qwen3.check(ids, media)
    retimed = ids.clone()
    second_stamp = head.shape[1] + video.shape[1] // 2 + 1  # a digit of the second frame's timestamp
    retimed[0, second_stamp] = 4 if int(retimed[0, second_stamp]) != 4 else 5
    qwen3.hits()
    qwen3.check(retimed, media)
    assert qwen3.hits() == head.shape[1] + timestamp(0.5).shape[1] + 1


def test_qwen3_vl_exact_repeat_skips_the_vision_tower(qwen3: Served) -> None:
    """Repeating an image-and-video prompt reuses all but the last token and encodes nothing."""
    ids = cat(text(3, 1), image_tokens(IMAGE), text(2, 2), qwen3_video_tokens(VIDEO), text(4, 3))
    media = Media(images=[(1, IMAGE)], videos=[(5, VIDEO, 0.5)])
    qwen3.check(ids, media)
    qwen3.hits()
    qwen3.check(ids, media)
    assert qwen3.hits() == ids.shape[1] - 1
    assert qwen3.encoded(ids, media, {"visual": "visual"}).total("visual") == 0


def test_qwen3_vl_prompt_ending_inside_a_video_never_cuts_inside_it(qwen3: Served) -> None:
    """When the token kept for logits is the last frame's placeholder, reuse stops at the video's first frame."""
    head = cat(text(3, 1), image_tokens(IMAGE), text(2, 2))
    video = qwen3_video_tokens(VIDEO)
    ids = cat(head, video[:, :-1])  # end on the last placeholder, not on vision end
    assert int(video[0, -1]) == VISION_END_ID
    media = Media(images=[(1, IMAGE)], videos=[(5, VIDEO, 0.5)])
    qwen3.check(ids, media)
    qwen3.hits()
    qwen3.check(ids, media)
    assert qwen3.hits() == head.shape[1] + timestamp(0.5).shape[1] + 1


def test_qwen3_vl_chat_with_a_video_in_a_later_turn(qwen3: Served) -> None:
    """Three turns (image, then a video, then text) each reuse the previous turn; unrelated requests in between."""
    other = cat(text(2, 7), image_tokens(SMALL_IMAGE))
    media = Media(images=[(1, IMAGE)])
    turn = cat(text(4, 10), image_tokens(IMAGE), text(5, 11))
    out = qwen3.check(turn, media)
    assert qwen3.hits() == 0
    for i, extra in enumerate([cat(qwen3_video_tokens(VIDEO), text(4, 13)), text(6, 14)]):
        # An unrelated request leaves its own rope_deltas on the model.
        generate(qwen3.model, other, NEW, **qwen3.kwargs(other, Media(images=[(2, SMALL_IMAGE)])))
        if i == 0:
            media = Media(images=[(1, IMAGE)], videos=[(5, VIDEO, 0.5)])
        previous = out.sequences.shape[1]
        turn = cat(out.sequences, text(3, 12 + i), extra)
        out = qwen3.check(turn, media)
        assert qwen3.hits() == previous - 1
