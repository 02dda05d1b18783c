"""The Qwen3-Omni thinker through the store equals cold runs and reuses exactly what is the same.

Every request runs cold and through the store (equal tokens, logits within 1e-4), passing all
media every time as a processor would: clips, images, videos (with fractional temporal
spacing), a video with its soundtrack, text-only chats, and the audio tower's per-call padding
(a clip shorter than a chunk is padded to its call's longest chunk). Hits are counted in
`stats().hit_tokens`; encoder work with forward hooks on the towers.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from conftest import assert_same_as_cold, generate, max_logit_diff
from transformers import DynamicCache

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.media.qwen3_omni import audio_tokens, cached_qwen3_omni, clip_tokens
from hf_prefix_cache.testing.tiny_qwen_media import (
    AUDIO_END_ID,
    AUDIO_START_ID,
    EncoderCalls,
    Media,
    image_tokens,
    omni_video_tokens,
)
from hf_prefix_cache.testing.tiny_vlm_media import run, text
from hf_prefix_cache.testing.tiny_vlm_parts import AUDIO_ID, VIDEO_ID, VISION_END_ID, VISION_START_ID

NEW = 5
SUPPRESS = list(range(100, 128))
IMAGE, SMALL_IMAGE, VIDEO = (1, 4, 6), (1, 2, 4), (2, 4, 4)
TOWERS = {"audio": "audio_tower", "visual": "visual"}
PADDED = 300  # every clip's feature row is this long (the feature extractor pads a call's clips to one length)


class Served:
    """The thinker, its store, and the hit tokens of the last request."""

    def __init__(self) -> None:
        self.model = cached_qwen3_omni()
        self.store = PrefixCache(self.model)
        self._seen = 0

    def kwargs(self, ids: torch.Tensor, media: Media, audio_in_video: bool = False) -> dict[str, Any]:
        media.clip_padding = PADDED
        return media.kwargs(ids, audio_in_video=audio_in_video)

    def check(self, ids: torch.Tensor, media: Media, audio_in_video: bool = False) -> Any:
        kwargs = {**self.kwargs(ids, media, audio_in_video), "suppress_tokens": SUPPRESS}
        return assert_same_as_cold(self.model, ids, self.store, new=NEW, **kwargs)

    def hits(self) -> int:
        now = self.store.stats().hit_tokens
        hit, self._seen = now - self._seen, now
        return hit

    def encoded(self, ids: torch.Tensor, media: Media, audio_in_video: bool = False) -> EncoderCalls:
        """Run through the store only; what each tower saw (patch rows, or audio frames)."""
        with EncoderCalls(self.model, TOWERS) as calls:
            generate(self.model, ids, NEW, past_key_values=self.store, **self.kwargs(ids, media, audio_in_video))
        return calls


@pytest.fixture
def omni() -> Iterator[Served]:
    served = Served()
    yield served
    served.store.check_integrity()
    assert not served.store.stats().fallbacks, served.store.stats().fallbacks
    served.store.detach()


def cat(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts, dim=1)


def audio_in_video_tokens(grid: tuple[int, int, int], seconds: float, frames: int) -> torch.Tensor:
    """A video with its soundtrack, as the Qwen3-Omni processor writes it: each video placeholder at its time.

    Vision start, audio start, then video and audio placeholders merged by position (a video
    grid's at ``t * seconds * 2``, the clip's ``0, 1, 2, ...``; video first on ties), audio end, vision end.
    """
    t, h, w = grid
    video_times = list(np.repeat(np.arange(t), h * w // 4) * seconds * 2)
    audio_times = list(range(audio_tokens(frames)))
    ids = [VISION_START_ID, AUDIO_START_ID]
    v = a = 0
    while v < len(video_times) and a < len(audio_times):
        if video_times[v] <= audio_times[a]:
            ids, v = [*ids, VIDEO_ID], v + 1
        else:
            ids, a = [*ids, AUDIO_ID], a + 1
    ids += [VIDEO_ID] * (len(video_times) - v) + [AUDIO_ID] * (len(audio_times) - a)
    return torch.tensor([[*ids, AUDIO_END_ID, VISION_END_ID]])


def test_clip_cached_then_image_in_the_suffix(omni: Served) -> None:
    """An image after a cached clip reuses the clip: the audio tower does not run, the vision tower sees the image only."""
    head = cat(text(4, 1), clip_tokens(140), text(3, 2))
    omni.check(head, Media(clips=[(1, 140)]))
    ids = cat(head, run(99, 1), image_tokens(IMAGE), text(3, 3))
    both = Media(images=[(2, IMAGE)], clips=[(1, 140)])
    omni.hits()
    omni.check(ids, both)
    assert omni.hits() == head.shape[1]
    omni.store.clear()
    omni.check(head, Media(clips=[(1, 140)]))
    omni.hits()
    calls = omni.encoded(ids, both)
    assert (calls.total("audio"), calls.total("visual")) == (0, 4 * 6)


def test_changed_clip_then_repeat(omni: Served) -> None:
    """Identical ids with another clip reuse nothing past its start; the first clip again reuses all; no encoder runs."""
    head = text(5, 1)
    ids = cat(head, clip_tokens(140), text(3, 2), image_tokens(IMAGE), text(3, 4))
    omni.check(ids, Media(images=[(2, IMAGE)], clips=[(1, 140)]))
    omni.hits()
    omni.check(ids, Media(images=[(2, IMAGE)], clips=[(13, 140)]))
    assert omni.hits() == head.shape[1] + 1  # audio start is text
    omni.check(ids, Media(images=[(2, IMAGE)], clips=[(1, 140)]))
    assert omni.hits() == ids.shape[1] - 1
    calls = omni.encoded(ids, Media(images=[(2, IMAGE)], clips=[(1, 140)]))
    assert (calls.total("audio"), calls.total("visual")) == (0, 0)


def test_short_clip_after_a_cached_long_one_is_padded_as_in_the_cold_run(omni: Served) -> None:
    """A clip shorter than a chunk in the suffix, after a cached whole-chunk clip: the cold run pads it to a
    whole chunk, so the hit does too (a zero clip after it); without that its last feature differs."""
    head = cat(text(4, 1), clip_tokens(150), text(3, 2))
    omni.check(head, Media(clips=[(1, 150)]))
    ids = cat(head, text(2, 5), clip_tokens(60), text(3, 3))
    omni.hits()
    omni.check(ids, Media(clips=[(1, 150), (3, 60)]))
    assert omni.hits() == head.shape[1]


def test_short_clips_are_keyed_by_their_calls_padding(omni: Served) -> None:
    """Every clip shorter than a chunk: the call pads to its longest clip, so a longer clip added later changes the
    first clip's features and reuse stops at its start; the same call again reuses all."""
    head = cat(text(4, 1), clip_tokens(30), text(3, 2))
    omni.check(head, Media(clips=[(1, 30)]))
    ids = cat(head, text(2, 5), clip_tokens(70), text(3, 3))
    media = Media(clips=[(1, 30), (3, 70)])
    omni.hits()
    omni.check(ids, media)
    assert omni.hits() == 4 + 1  # audio start is text
    omni.check(ids, media)
    assert omni.hits() == ids.shape[1] - 1


@pytest.mark.parametrize("seconds", [1.0, 0.75], ids=["whole", "fractional"])
def test_video_positions_and_stale_rope_deltas(omni: Served, seconds: float) -> None:
    """A video cached, then an image: exact after an unrelated request leaves its rope_deltas, with whole and
    fractional temporal spacing (float positions, never rounded); another spacing stops reuse at the video."""
    head = cat(text(3, 1), omni_video_tokens(VIDEO), text(2, 2))
    omni.check(head, Media(videos=[(5, VIDEO, seconds)]))
    other = cat(text(2, 7), image_tokens(SMALL_IMAGE), text(9, 8))
    generate(omni.model, other, NEW, **omni.kwargs(other, Media(images=[(3, SMALL_IMAGE)])))
    ids = cat(head, run(99, 1), image_tokens(IMAGE), text(3, 3))
    omni.hits()
    omni.check(ids, Media(images=[(2, IMAGE)], videos=[(5, VIDEO, seconds)]))
    assert omni.hits() == head.shape[1]
    omni.check(ids, Media(images=[(2, IMAGE)], videos=[(5, VIDEO, seconds * 2)]))
    assert omni.hits() == 3 + 1  # vision start is text


def test_builtin_path_with_stale_rope_deltas_is_wrong(omni: Served) -> None:
    """Control: the thinker's own path on a restored prefix with suffix media reads stale rope_deltas and differs."""
    model = omni.model
    head = cat(text(3, 1), omni_video_tokens(VIDEO), text(2, 2))
    ids = cat(head, run(99, 1), image_tokens(IMAGE), text(3, 3))
    media = Media(images=[(2, IMAGE)], videos=[(5, VIDEO, 1.0)])
    cold = generate(model, ids, NEW, **omni.kwargs(ids, media))
    other = cat(text(2, 7), image_tokens(SMALL_IMAGE), text(9, 8))
    generate(model, other, NEW, **omni.kwargs(other, Media(images=[(3, SMALL_IMAGE)])))
    stale = model.model.rope_deltas.clone()
    warm = generate(model, ids, NEW, past_key_values=omni.store, **omni.kwargs(ids, media))
    assert torch.equal(warm.sequences, cold.sequences) and max_logit_diff(warm, cold) < 1e-4
    built_in = DynamicCache()
    with torch.no_grad():
        prefix = omni.kwargs(head, Media(videos=[(5, VIDEO, 1.0)]))
        model(head, attention_mask=torch.ones_like(head), past_key_values=built_in, use_cache=True, **prefix)
    model.model.rope_deltas = stale
    suffix = omni.kwargs(ids, Media(images=[(2, IMAGE)]))
    out = generate(model, ids, NEW, past_key_values=built_in, **suffix)
    assert max_logit_diff(out, cold) > 1e-4


def test_audio_in_video_block_is_one_item(omni: Served) -> None:
    """With `use_audio_in_video`, a video and its interleaved clip are one item: cached, changed, repeated."""
    block = audio_in_video_tokens(VIDEO, 1.0, 140)
    head = cat(text(4, 1), block, text(3, 2))
    omni.check(head, Media(videos=[(5, VIDEO, 1.0)], clips=[(1, 140)]), audio_in_video=True)
    ids = cat(head, run(99, 1), image_tokens(IMAGE), text(3, 3))
    media = Media(images=[(2, IMAGE)], videos=[(5, VIDEO, 1.0)], clips=[(1, 140)])
    omni.hits()
    omni.check(ids, media, audio_in_video=True)
    assert omni.hits() == head.shape[1]
    changed = Media(images=[(2, IMAGE)], videos=[(5, VIDEO, 1.0)], clips=[(13, 140)])
    omni.check(ids, changed, audio_in_video=True)
    assert omni.hits() == 4 + 2  # vision start and audio start are text
    omni.check(ids, media, audio_in_video=True)
    assert omni.hits() == ids.shape[1] - 1
    calls = omni.encoded(ids, media, audio_in_video=True)
    assert (calls.total("audio"), calls.total("visual")) == (0, 0)


def test_text_only_chat_after_media_requests(omni: Served) -> None:
    """Text-only prompts are served, with rope_deltas of media requests left on the model in between."""
    other = cat(text(2, 7), image_tokens(SMALL_IMAGE), clip_tokens(30))
    turn, previous = text(20, 9), 1
    for i in range(3):
        generate(omni.model, other, NEW, **omni.kwargs(other, Media(images=[(3, SMALL_IMAGE)], clips=[(3, 30)])))
        out = omni.check(turn, Media())
        assert omni.hits() == previous - 1
        previous = out.sequences.shape[1]
        turn = cat(out.sequences, text(4, 20 + i))
