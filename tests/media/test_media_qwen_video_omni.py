"""Qwen3-VL videos and the Qwen2.5-Omni thinker through the store equal cold runs and reuse exactly what is the same.

Every request runs cold and through the store (equal tokens, logits within 1e-4), passing all
media every time as a processor would. Hits are counted in `stats().hit_tokens`; encoder work
is counted with forward hooks on the vision and audio towers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import assert_same_as_cold, generate, max_logit_diff
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.media.harness import served
from hf_prefix_cache.testing.reference import longest_prefix, span_cut
from hf_prefix_cache.testing.tiny_qwen_media import (
    AUDIO_END_ID,
    AUDIO_ID,
    AUDIO_START_ID,
    EncoderCalls,
    Media,
    cached_omni,
    image_tokens,
    omni_audio_in_video_tokens,
    omni_audio_tokens,
    omni_video_tokens,
    qwen3_video_tokens,
    timestamp,
)
from hf_prefix_cache.testing.tiny_vlm_media import run, text
from hf_prefix_cache.testing.tiny_vlm_parts import IMAGE_ID, VISION_END_ID, VISION_START_ID
from hf_prefix_cache.testing.tiny_vlms import cached_vlm

NEW = 5
# Answers never contain media or framing ids, so a later turn built from them stays a valid prompt.
SUPPRESS = list(range(100, 128))
IMAGE, SMALL_IMAGE, VIDEO = (1, 4, 6), (1, 2, 4), (2, 4, 4)
OMNI_TOWERS = {"audio": "audio_tower", "visual": "visual"}


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


def _checked(served: Served) -> Iterator[Served]:
    """Yield `served`; then check its store's integrity, that nothing fell back, and detach it."""
    yield served
    served.store.check_integrity()
    assert not served.store.stats().fallbacks, served.store.stats().fallbacks
    served.store.detach()


@pytest.fixture
def qwen3() -> Iterator[Served]:
    yield from _checked(Served(cached_vlm("qwen3_vl"), qwen3=True))


@pytest.fixture
def omni() -> Iterator[Served]:
    yield from _checked(Served(cached_omni()))


def cat(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts, dim=1)


# --------------------------------------------------------------------------- Qwen3-VL videos


@pytest.mark.parametrize(
    ("cached", "rows"), [("image", 2 * 4 * 4), ("video", 4 * 6)], ids=["video-after-image", "image-after-video"]
)
def test_qwen3_vl_a_medium_after_a_cached_one_is_the_only_one_encoded(qwen3: Served, cached: str, rows: int) -> None:
    """A video after a cached image (or an image after a cached video, all its frames and timestamps) reuses the
    cached medium's prefix and is the only medium encoded."""
    tokens = {"image": image_tokens(IMAGE), "video": qwen3_video_tokens(VIDEO)}
    added = "video" if cached == "image" else "image"
    head = cat(text(4, 1), tokens[cached], text(3, 2))
    first = Media(images=[(1, IMAGE)]) if cached == "image" else Media(videos=[(5, VIDEO, 0.5)])
    qwen3.check(head, first)
    ids = cat(head, run(99, 1), tokens[added], text(3, 3))
    both = Media(images=[(1, IMAGE)], videos=[(5, VIDEO, 0.5)])
    qwen3.hits()
    qwen3.check(ids, both)
    assert qwen3.hits() == head.shape[1]
    qwen3.store.clear()
    qwen3.check(head, first)
    qwen3.hits()
    assert qwen3.encoded(ids, both, {"visual": "visual"}).total("visual") == rows


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


# --------------------------------------------------------------------------- Qwen2.5-Omni thinker


def test_omni_audio_cached_then_image_in_the_suffix(omni: Served) -> None:
    """An image after a cached audio clip reuses the clip; the audio tower does not run, the vision tower sees the image only."""
    head = cat(text(4, 1), omni_audio_tokens(60), text(3, 2))
    first = Media(clips=[(1, 60)])
    omni.check(head, first)
    ids = cat(head, run(99, 1), image_tokens(IMAGE), text(3, 3))
    both = Media(images=[(2, IMAGE)], clips=[(1, 60)])
    omni.hits()
    omni.check(ids, both)
    assert omni.hits() == head.shape[1]
    omni.store.clear()
    omni.check(head, first)
    omni.hits()
    calls = omni.encoded(ids, both, OMNI_TOWERS)
    assert (calls.total("audio"), calls.total("visual")) == (0, 4 * 6)


def test_omni_image_cached_then_audio_in_the_suffix(omni: Served) -> None:
    """A clip after a cached image reuses the image; only the new clip's frames reach the audio tower."""
    head = cat(text(4, 1), image_tokens(IMAGE), text(3, 2))
    first = Media(images=[(2, IMAGE)])
    omni.check(head, first)
    ids = cat(head, run(99, 1), omni_audio_tokens(44), text(3, 3))
    both = Media(images=[(2, IMAGE)], clips=[(1, 44)])
    omni.hits()
    omni.check(ids, both)
    assert omni.hits() == head.shape[1]
    omni.store.clear()
    omni.check(head, first)
    omni.hits()
    calls = omni.encoded(ids, both, OMNI_TOWERS)
    assert (calls.total("audio"), calls.total("visual")) == (44, 0)


def test_omni_changed_audio_with_identical_tokens(omni: Served) -> None:
    """Identical ids with another clip of the same length reuse nothing past the clip's start."""
    head = text(5, 1)
    ids = cat(head, omni_audio_tokens(60), text(3, 2), image_tokens(IMAGE), text(3, 4))
    omni.check(ids, Media(images=[(2, IMAGE)], clips=[(1, 60)]))
    omni.hits()
    omni.check(ids, Media(images=[(2, IMAGE)], clips=[(13, 60)]))
    assert omni.hits() == head.shape[1] + 1  # audio start is text
    omni.check(ids, Media(images=[(2, IMAGE)], clips=[(1, 60)]))
    assert omni.hits() == ids.shape[1] - 1


def test_omni_three_turn_chat_with_new_media_in_later_turns(omni: Served) -> None:
    """Turn 1 a clip, turn 2 an image and a video, turn 3 another clip: each reuses the previous turn exactly."""
    other = cat(text(2, 7), image_tokens(SMALL_IMAGE), omni_audio_tokens(30))
    other_media = Media(images=[(3, SMALL_IMAGE)], clips=[(3, 30)])
    turn = cat(text(4, 10), omni_audio_tokens(60), text(5, 11))
    out = omni.check(turn, Media(clips=[(1, 60)]))
    assert omni.hits() == 0
    turns = [
        (
            cat(image_tokens(IMAGE), text(2, 13), omni_video_tokens(VIDEO), text(2, 14)),
            Media(images=[(2, IMAGE)], videos=[(5, VIDEO, 1.0)], clips=[(1, 60)]),
        ),
        (
            cat(omni_audio_tokens(44), text(3, 15)),
            Media(images=[(2, IMAGE)], videos=[(5, VIDEO, 1.0)], clips=[(1, 60), (4, 44)]),
        ),
    ]
    for i, (extra, media) in enumerate(turns):
        generate(omni.model, other, NEW, **omni.kwargs(other, other_media))  # leaves its own rope_deltas
        previous = out.sequences.shape[1]
        turn = cat(out.sequences, text(3, 12 + i), extra)
        if i == 1:
            # Served alone first: only the new clip reaches an encoder.
            calls = omni.encoded(turn, media, OMNI_TOWERS)
            assert (calls.total("audio"), calls.total("visual")) == (44, 0)
            assert omni.hits() == previous - 1
        out = omni.check(turn, media)
        assert omni.hits() == (previous - 1 if i == 0 else turn.shape[1] - 1)


def test_omni_exact_repeat_runs_no_encoder(omni: Served) -> None:
    """Repeating a prompt with a clip, an image and a video reuses all but the last token; no encoder runs."""
    ids = cat(
        text(3, 1),
        omni_audio_tokens(60),
        text(2, 2),
        image_tokens(IMAGE),
        text(2, 3),
        omni_video_tokens(VIDEO),
        text(3, 4),
    )
    media = Media(images=[(2, IMAGE)], videos=[(5, VIDEO, 1.0)], clips=[(1, 60)])
    omni.check(ids, media)
    omni.hits()
    omni.check(ids, media)
    assert omni.hits() == ids.shape[1] - 1
    calls = omni.encoded(ids, media, OMNI_TOWERS)
    assert (calls.total("audio"), calls.total("visual")) == (0, 0)


def test_omni_video_spacing_is_part_of_the_video(omni: Served) -> None:
    """Another `video_second_per_grid` moves the video's positions: reuse stops at the video's start."""
    head = cat(text(3, 1), omni_audio_tokens(60), text(2, 2))
    ids = cat(head, omni_video_tokens(VIDEO), text(3, 4))
    omni.check(ids, Media(videos=[(5, VIDEO, 1.0)], clips=[(1, 60)]))
    omni.hits()
    omni.check(ids, Media(videos=[(5, VIDEO, 2.0)], clips=[(1, 60)]))
    assert omni.hits() == head.shape[1] + 1  # vision start is text


def test_omni_clip_padded_differently_in_a_later_prompt_still_matches(omni: Served) -> None:
    """A clip is keyed by its valid frames: padded to a longer clip's length in turn 2, it still matches."""
    turn = cat(text(4, 1), omni_audio_tokens(60), text(3, 2))
    out = omni.check(turn, Media(clips=[(1, 60)]))
    turn = cat(out.sequences, text(2, 3), omni_audio_tokens(110), text(3, 4))
    omni.hits()
    omni.check(turn, Media(clips=[(1, 60), (2, 110)], clip_padding=120))
    assert omni.hits() == out.sequences.shape[1] - 1


def test_omni_stale_rope_deltas_are_never_used(omni: Served) -> None:
    """After an unrelated request leaves its rope_deltas, a hit with an image in the suffix equals the cold run.

    The thinker's own path (a filled cache plus suffix media, no explicit positions) reads the
    stale deltas and is measurably wrong here: the store must not take it.
    """
    model = omni.model
    head = cat(text(4, 1), omni_audio_tokens(60), text(3, 2))
    omni.check(head, Media(clips=[(1, 60)]))
    ids = cat(head, run(99, 1), image_tokens(IMAGE), text(3, 3))
    media = Media(images=[(2, IMAGE)], clips=[(1, 60)])
    cold = generate(model, ids, NEW, **omni.kwargs(ids, media))
    other = cat(text(2, 7), image_tokens(SMALL_IMAGE), text(9, 8))
    generate(model, other, NEW, **omni.kwargs(other, Media(images=[(3, SMALL_IMAGE)])))
    stale = model.model.rope_deltas.clone()
    omni.hits()
    warm = generate(model, ids, NEW, past_key_values=omni.store, **omni.kwargs(ids, media))
    assert omni.hits() == head.shape[1]
    assert torch.equal(warm.sequences, cold.sequences)
    assert max_logit_diff(warm, cold) < 1e-4
    # Control: the built-in path on the same prefix and suffix media, with the stale deltas back in place.
    cache = DynamicCache()
    with torch.no_grad():
        prefix_media = omni.kwargs(head, Media(clips=[(1, 60)]))
        model(head, attention_mask=torch.ones_like(head), past_key_values=cache, use_cache=True, **prefix_media)
    model.model.rope_deltas = stale
    suffix_media = {
        "pixel_values": media.kwargs(ids)["pixel_values"],
        "image_grid_thw": media.kwargs(ids)["image_grid_thw"],
    }
    builtin = generate(model, ids, NEW, past_key_values=cache, **suffix_media)
    assert max_logit_diff(builtin, cold) > 1e-4


def test_omni_text_only_chat_after_media_requests(omni: Served) -> None:
    """Text-only prompts are served too, with rope_deltas of media requests left on the model in between."""
    other = cat(text(2, 7), image_tokens(SMALL_IMAGE), omni_audio_tokens(30))
    turn, previous = text(20, 9), 1
    for i in range(3):
        generate(omni.model, other, NEW, **omni.kwargs(other, Media(images=[(3, SMALL_IMAGE)], clips=[(3, 30)])))
        out = omni.check(turn, Media())
        assert omni.hits() == previous - 1
        previous = out.sequences.shape[1]
        turn = cat(out.sequences, text(4, 20 + i))


# --------------------------------------------------------------------------- audio inside videos


def test_omni_audio_in_video_block_is_one_item(omni: Served) -> None:
    """With `use_audio_in_video`, a video and its interleaved clip are one item: cached, changed, repeated."""
    head = cat(text(4, 1), omni_audio_in_video_tokens(VIDEO, 1.0, 60), text(3, 2))
    starts = (head == AUDIO_ID).int().diff().eq(1).sum()
    assert starts == 2  # video 4, audio 2, video 4, audio 13: both are split across runs
    block = Media(videos=[(5, VIDEO, 1.0)], clips=[(1, 60)])
    omni.check(head, block, audio_in_video=True)
    ids = cat(head, run(99, 1), image_tokens(IMAGE), text(3, 3))
    media = Media(images=[(2, IMAGE)], videos=[(5, VIDEO, 1.0)], clips=[(1, 60)])
    omni.hits()
    omni.check(ids, media, audio_in_video=True)
    assert omni.hits() == head.shape[1]
    # Another soundtrack under the same frames: reuse stops at the block's first placeholder.
    omni.check(ids, Media(images=[(2, IMAGE)], videos=[(5, VIDEO, 1.0)], clips=[(13, 60)]), audio_in_video=True)
    assert omni.hits() == 4 + 2  # vision start and audio start are text
    omni.check(ids, media, audio_in_video=True)
    assert omni.hits() == ids.shape[1] - 1
    calls = omni.encoded(ids, media, OMNI_TOWERS, audio_in_video=True)
    assert (calls.total("audio"), calls.total("visual")) == (0, 0)


def test_omni_audio_in_video_block_in_the_suffix_after_a_cached_clip(omni: Served) -> None:
    """A standalone clip cached, then a video with its soundtrack: only the block's clip and frames are encoded."""
    head = cat(text(4, 1), omni_audio_tokens(44), text(3, 2))
    omni.check(head, Media(clips=[(4, 44)]), audio_in_video=True)
    ids = cat(head, run(99, 1), omni_audio_in_video_tokens(VIDEO, 1.0, 60), text(3, 3))
    media = Media(videos=[(5, VIDEO, 1.0)], clips=[(4, 44), (1, 60)])
    omni.hits()
    omni.check(ids, media, audio_in_video=True)
    assert omni.hits() == head.shape[1]
    omni.store.clear()
    omni.check(head, Media(clips=[(4, 44)]), audio_in_video=True)
    omni.hits()
    calls = omni.encoded(ids, media, OMNI_TOWERS, audio_in_video=True)
    assert (calls.total("audio"), calls.total("visual")) == (60, 2 * 4 * 4)


# --------------------------------------------------------------------------- counts the thinker does not check


@pytest.mark.parametrize(
    ("name", "ids", "media"),
    [
        (
            "audio one short",
            cat(text(3, 1), run(AUDIO_START_ID, 1), run(AUDIO_ID, 14), run(AUDIO_END_ID, 1), text(3, 2)),
            Media(clips=[(1, 60)]),
        ),
        (
            "audio one long",
            cat(text(3, 1), run(AUDIO_START_ID, 1), run(AUDIO_ID, 16), run(AUDIO_END_ID, 1), text(3, 2)),
            Media(clips=[(1, 60)]),
        ),
        ("two clips, one run", cat(text(3, 1), omni_audio_tokens(60), text(3, 2)), Media(clips=[(1, 60), (2, 60)])),
        (
            "image one short",
            cat(text(3, 1), run(VISION_START_ID, 1), run(IMAGE_ID, 5), run(VISION_END_ID, 1), text(3, 2)),
            Media(images=[(2, IMAGE)]),
        ),
    ],
)
def test_omni_placeholders_that_do_not_match_the_media_run_cold(name: str, ids: torch.Tensor, media: Media) -> None:
    """Placeholder counts that disagree with the clips or grids run cold (`media_placeholders`), never served."""
    model = cached_omni()
    with served(model, clean=False) as store:
        for _ in range(2):
            # The thinker may silently misassign features here, or raise; either way it is its own cold run.
            with contextlib.suppress(RuntimeError, ValueError, IndexError):
                generate(model, ids, 3, past_key_values=store, **media.kwargs(ids))
        assert store.stats().fallbacks == {"media_placeholders": 2}
        assert store.stats().entries == 0


def test_full_omni_model_is_refused_and_its_thinker_is_served() -> None:
    """The thinker + talker wrapper runs cold as `thinker_talker`; a store on `model.thinker` reuses."""
    import transformers

    thinker = cached_omni()
    config = transformers.Qwen2_5OmniConfig(thinker_config=thinker.config.to_dict(), enable_audio_output=False)
    full = transformers.Qwen2_5OmniForConditionalGeneration(config).eval()
    full.thinker.load_state_dict(thinker.state_dict())
    with served(full, clean=False) as store:
        # Every request through the wrapper then runs cold under this name (the profile's reason).
        assert store._store.profile.unsupported == "thinker_talker"
    ids = text(20, 3)
    on_thinker = Served(full.thinker)
    try:
        on_thinker.check(ids, Media())
        on_thinker.check(ids, Media())
        assert on_thinker.hits() == ids.shape[1] - 1
    finally:
        on_thinker.store.detach()


# --------------------------------------------------------------------------- random conversations

_IMAGE_POOL = [(10, IMAGE), (11, SMALL_IMAGE), (12, IMAGE)]
_VIDEO_POOL = [(20, VIDEO, 1.0), (21, VIDEO, 0.5), (22, VIDEO, 1.0)]
_CLIP_POOL = [(30, 40), (31, 30), (32, 44)]
_omni_pieces = st.one_of(
    st.lists(st.integers(4, 7), min_size=1, max_size=4),
    st.tuples(st.sampled_from(["image", "video", "audio"]), st.integers(0, 2)),
)
_omni_requests = st.lists(
    st.tuples(st.lists(_omni_pieces, min_size=1, max_size=4), st.booleans()), min_size=1, max_size=3
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversation=_omni_requests)
def test_omni_random_conversations_reuse_exactly_what_the_rules_allow(conversation: list[Any]) -> None:
    """Random chats of text, images, videos and clips through the Omni thinker equal cold runs and
    reuse the longest prefix stored with the same media before the cut (never inside a medium)."""
    store = PrefixCache(cached_omni())
    stored: list[list[Any]] = []
    previous: tuple[list[int], Media, list[Any], list[tuple[int, int]]] | None = None
    try:
        for new_pieces, continues in conversation:
            if continues and previous is not None:
                ids, old, symbols, spans = previous
                media = Media(images=list(old.images), videos=list(old.videos), clips=list(old.clips))
                ids, symbols, spans = list(ids), list(symbols), list(spans)
            else:
                ids, media, symbols, spans = [], Media(), [], []
            for piece in new_pieces:
                if isinstance(piece, list):
                    ids += piece
                    symbols += piece
                    continue
                kind, index = piece
                if kind == "image":
                    tokens = image_tokens(_IMAGE_POOL[index][1])
                    media.images.append(_IMAGE_POOL[index])
                elif kind == "video":
                    tokens = omni_video_tokens(_VIDEO_POOL[index][1])
                    media.videos.append(_VIDEO_POOL[index])
                else:
                    tokens = omni_audio_tokens(_CLIP_POOL[index][1])
                    media.clips.append(_CLIP_POOL[index])
                body = tokens[0, 1:-1].tolist()  # the placeholders between the framing ids
                start = len(ids) + 1
                spans.append((start, start + len(body)))
                ids += tokens[0].tolist()
                symbols += [int(tokens[0, 0]), *[(kind, index, j) for j in range(len(body))], int(tokens[0, -1])]
            cut = span_cut(longest_prefix(stored, symbols), len(ids), spans)
            prompt = torch.tensor([ids])
            before = store.stats().hit_tokens
            out = assert_same_as_cold(
                store.model, prompt, store, new=NEW, suppress_tokens=SUPPRESS, **media.kwargs(prompt)
            )
            assert store.stats().hit_tokens - before == cut
            answer = out.sequences[0, len(ids) :].tolist()
            stored.append(symbols + answer[:-1])
            previous = (ids + answer, media, symbols + answer, spans)
        assert not store.stats().fallbacks, store.stats().fallbacks
        store.check_integrity()
    finally:
        store.detach()
