"""Vision-language models through the store equal cold runs, and reuse exactly what is the same.

Every request runs cold and through the store (`assert_same_as_cold`: equal tokens, logits
within 1e-4), passing all media every time as a processor would; the store must hand
`generate` only the media of the uncached suffix. Hits are counted in `stats().hit_tokens`.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import Hits, assert_same_as_cold, generate, max_logit_diff

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.media.families import ANYRES, FAMILIES, FRAMED, GLM, NEW, QWEN_VL, SPECIAL_IDS, Family
from hf_prefix_cache.testing.media.harness import served
from hf_prefix_cache.testing.tiny_processors import llava_next_processor
from hf_prefix_cache.testing.tiny_vlm_media import pil_image, qwen_pixels, run, text, video_frames
from hf_prefix_cache.testing.tiny_vlm_parts import IMAGE_ID, VIDEO_ID, VISION_END_ID, VISION_START_ID
from media.conftest import family_fixture

family = family_fixture(Family, FAMILIES)


def _num_patches(fam: Family, kwargs: dict[str, Any]) -> int:
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    config = fam.model.config
    return sum(
        image_size_to_num_patches(size, config.image_grid_pinpoints, config.vision_config.image_size)
        for size in kwargs["image_sizes"]
    )


def test_second_image_in_the_suffix(family: tuple[Family, PrefixCache]) -> None:
    """A prompt adding a second image after a cached first one reuses the first and encodes only the second."""
    fam, store = family
    hits = Hits(store)
    img1, img2 = fam.image(1), fam.image(2)
    prefix = torch.cat([text(5, 1), fam.placeholders(img1), text(6, 2)], dim=1)
    fam.check(prefix, [img1], store)
    second = torch.cat([prefix, run(99, 1), text(4, 3), fam.placeholders(img2), text(3, 4)], dim=1)
    fam.check(second, [img1, img2], store)
    assert hits.last() == prefix.shape[1]
    store.clear()
    fam.check(prefix, [img1], store)
    # Only the second item reaches the encoder (LLaVA-NeXT: its valid patches; Qwen2-VL: its rows; audio: its clip).
    alone = fam.kwargs(second, [img2])
    expected = alone["input_features" if fam.name == "qwen2_audio" else "pixel_values"].shape[0]
    if fam.name in ANYRES:
        expected = _num_patches(fam, alone)
    assert fam.encoded(second, [img1, img2], store) == expected


def test_changed_first_image_with_identical_tokens(family: tuple[Family, PrefixCache]) -> None:
    """Identical token ids with another first image reuse nothing past that image's start."""
    fam, store = family
    hits = Hits(store)
    img1, other, img2 = fam.image(1), fam.image(13), fam.image(2)  # seeds 1 and 13: same size, other pixels
    head = text(5, 1)
    ids = torch.cat([head, fam.placeholders(img1), text(6, 2), fam.placeholders(img2), text(3, 4)], dim=1)
    assert torch.equal(fam.placeholders(img1), fam.placeholders(other))
    fam.check(ids, [img1, img2], store)
    fam.check(ids, [other, img2], store)
    assert hits.last() == head.shape[1] + (1 if fam.name in FRAMED else 0)  # vision-start / begin-of-image is text
    fam.check(ids, [img1, img2], store)
    assert hits.last() == ids.shape[1] - 1


def test_multi_turn_chat_with_a_new_image_later(family: tuple[Family, PrefixCache]) -> None:
    """Each turn reuses the previous turn's prompt and answer; a new image in turn 2 is the only one encoded."""
    fam, store = family
    hits = Hits(store)
    img1, img2 = fam.image(1), fam.image(2)
    turn = torch.cat([text(4, 10), fam.placeholders(img1), text(5, 11)], dim=1)
    out = fam.check(turn, [img1], store)
    assert hits.last() == 0
    previous = out.sequences.shape[1]
    turn = torch.cat([out.sequences, text(3, 12), fam.placeholders(img2), text(4, 13)], dim=1)
    out = fam.check(turn, [img1, img2], store)
    assert hits.last() == previous - 1
    previous = out.sequences.shape[1]
    turn = torch.cat([out.sequences, text(6, 14)], dim=1)
    fam.check(turn, [img1, img2], store)
    assert hits.last() == previous - 1


def test_exact_repeat(family: tuple[Family, PrefixCache]) -> None:
    """Repeating a two-image prompt reuses all but the last token and passes no media."""
    fam, store = family
    hits = Hits(store)
    img1, img2 = fam.image(1), fam.image(2)
    ids = torch.cat([text(3, 1), fam.placeholders(img1), text(2, 2), fam.placeholders(img2), text(4, 3)], dim=1)
    fam.check(ids, [img1, img2], store)
    fam.check(ids, [img1, img2], store)
    assert hits.last() == ids.shape[1] - 1
    assert fam.encoded(ids, [img1, img2], store) == 0  # a hit covering all media skips the encoder


def test_prompt_ending_in_an_image_never_cuts_inside_it(family: tuple[Family, PrefixCache]) -> None:
    """When the token kept for logits is a placeholder, the reuse stops at that image's start."""
    fam, store = family
    hits = Hits(store)
    img1, img2 = fam.image(1), fam.image(2)
    head = torch.cat([text(3, 1), fam.placeholders(img1), text(2, 2)], dim=1)
    tail = fam.placeholders(img2)
    if fam.name in FRAMED:
        tail = tail[:, :-1]  # end on the last placeholder, not on vision-end / end-of-image
    ids = torch.cat([head, tail], dim=1)
    fam.check(ids, [img1, img2], store)
    fam.check(ids, [img1, img2], store)
    assert hits.last() == head.shape[1] + (1 if fam.name in FRAMED else 0)


#: M-RoPE families: explicit positions of the whole prompt, and a `rope_deltas` left on the model by each request.
MROPE = [*QWEN_VL, "qwen3_vl", *GLM, "paddleocr_vl"]


def _suppressed(name: str) -> dict[str, Any]:
    # GLM-4V and PaddleOCR-VL answers never contain placeholder or framing ids, so a later prompt built from one stays valid.
    return {"suppress_tokens": SPECIAL_IDS} if name in (*GLM, "paddleocr_vl") else {}


@pytest.mark.parametrize("name", MROPE)
def test_stale_rope_deltas_from_another_request_are_never_used(name: str) -> None:
    """A hit after an unrelated request (which leaves its rope_deltas on the model) stays exact."""
    fam = Family(name)
    extra = _suppressed(name)
    with served(fam.model, clean=False) as store:
        img1, img2 = fam.image(0), fam.image(1)
        ids = torch.cat([text(3, 1), fam.placeholders(img1), text(2, 2), fam.placeholders(img2), text(4, 3)], dim=1)
        cold = generate(fam.model, ids, NEW, **extra, **fam.kwargs(ids, [img1, img2]))
        generate(fam.model, ids, NEW, past_key_values=store, **extra, **fam.kwargs(ids, [img1, img2]))
        follow = torch.cat([cold.sequences, text(5, 4)], dim=1)
        cold_follow = generate(fam.model, follow, NEW, **extra, **fam.kwargs(follow, [img1, img2]))
        for other in (torch.cat([text(2, 7), fam.placeholders(img2)], dim=1), text(30, 8)):
            kwargs = fam.kwargs(other, [img2]) if other.shape[1] < 30 else {}
            generate(fam.model, other, NEW, **extra, **kwargs)  # cold, unrelated: leaves its own rope_deltas
            warm = generate(fam.model, follow, NEW, past_key_values=store, **extra, **fam.kwargs(follow, [img1, img2]))
            assert torch.equal(warm.sequences, cold_follow.sequences)
            assert max_logit_diff(warm, cold_follow) < 1e-4
        assert store.stats().hit_tokens == (cold.sequences.shape[1] - 1) + (follow.shape[1] - 1)
        assert not store.stats().fallbacks


@pytest.mark.parametrize("name", MROPE)
def test_text_only_prompts_reuse_exactly(name: str) -> None:
    """Text-only chats are served too (explicit positions), after media requests changed rope_deltas."""
    fam = Family(name)
    extra = _suppressed(name)
    with served(fam.model, clean=False) as store:
        img = fam.image(0)
        other = torch.cat([text(2, 7), fam.placeholders(img)], dim=1)
        turn, expected = text(20, 9), 0
        for i in range(3):
            cold = generate(fam.model, turn, NEW, **extra)
            generate(
                fam.model, other, NEW, **extra, **fam.kwargs(other, [img])
            )  # leaves image rope_deltas on the model
            warm = generate(fam.model, turn, NEW, past_key_values=store, **extra)
            assert torch.equal(warm.sequences, cold.sequences)
            assert max_logit_diff(warm, cold) < 1e-4
            if i:
                expected += turn.shape[1] - 4 - 1  # the previous prompt and answer, but the answer's last token
            turn = torch.cat([cold.sequences, text(4, 20 + i)], dim=1)
        assert store.stats().hit_tokens == expected > 0 and not store.stats().fallbacks


def test_llava_adjacent_images_in_one_placeholder_run() -> None:
    """LLaVA images with nothing between them are told apart by their equal placeholder counts."""
    fam = Family("llava")
    with served(fam.model, clean=False) as store:
        img1, img2, img3 = fam.image(1), fam.image(2), fam.image(3)
        head = torch.cat([text(3, 1), fam.placeholders(img1)], dim=1)
        fam.check(torch.cat([head, text(2, 2)], dim=1), [img1], store)
        ids = torch.cat([head, fam.placeholders(img2), fam.placeholders(img3), text(2, 2)], dim=1)
        fam.check(ids, [img1, img2, img3], store)
        assert store.stats().hit_tokens == head.shape[1]
        assert fam.encoded(ids, [img1, img2, img3], store) == 0


@pytest.mark.parametrize("name", QWEN_VL)
def test_qwen2_vl_image_cached_then_video_in_the_suffix(name: str) -> None:
    """The Qwen2-VL family keys images and videos apart; a video after a cached image is the only medium encoded."""
    fam = Family(name)
    with served(fam.model, clean=False) as store:
        image = fam.image(1)
        video_rows, video_grid = qwen_pixels(5, (2, 4, 4))
        n_video = int(video_grid.prod()) // 4
        head = torch.cat([text(4, 1), fam.placeholders(image), text(3, 2)], dim=1)
        fam.check(head, [image], store)
        video = torch.cat([run(VISION_START_ID, 1), run(VIDEO_ID, n_video), run(VISION_END_ID, 1)], dim=1)
        ids = torch.cat([head, run(99, 1), video, text(3, 3)], dim=1)
        kwargs = {
            **fam.kwargs(ids, [image]),
            "pixel_values_videos": video_rows,
            "video_grid_thw": video_grid,
            "mm_token_type_ids": (ids == IMAGE_ID).int() + 2 * (ids == VIDEO_ID).int(),
        }
        if name == "qwen2_5_vl":
            kwargs["second_per_grid_ts"] = torch.tensor([0.5])
        before = store.stats().hit_tokens
        assert_same_as_cold(fam.model, ids, store, new=NEW, **kwargs)
        assert store.stats().hit_tokens - before == head.shape[1]
        # The same ids with another video of the same grid reuse up to that video only.
        other = {**kwargs, "pixel_values_videos": qwen_pixels(6, (2, 4, 4))[0]}
        before = store.stats().hit_tokens
        assert_same_as_cold(fam.model, ids, store, new=NEW, **other)
        assert store.stats().hit_tokens - before == head.shape[1] + 2  # the separator and vision-start are text
        if name == "qwen2_5_vl":
            # Another temporal spacing changes the video's positions: reuse stops at the video again.
            before = store.stats().hit_tokens
            assert_same_as_cold(fam.model, ids, store, new=NEW, **{**kwargs, "second_per_grid_ts": torch.tensor([2.0])})
            assert store.stats().hit_tokens - before == head.shape[1] + 2
        assert not store.stats().fallbacks


def test_llava_next_image_padded_differently_in_a_later_prompt_still_matches() -> None:
    """LLaVA-NeXT: a small image, padded to a larger one's patch count in turn 2, keeps its key."""
    fam = Family("llava_next")
    with served(fam.model, clean=False) as store:
        small, large = pil_image(1, 32, 32), pil_image(2, 30, 60)
        alone = llava_next_processor()([small], return_tensors="pt")["pixel_values"]
        both = llava_next_processor()([small, large], return_tensors="pt")["pixel_values"]
        assert alone.shape[1] < both.shape[1]  # the same picture is a different tensor in turn 2
        turn = torch.cat([text(4, 1), fam.placeholders(small), text(3, 2)], dim=1)
        out = fam.check(turn, [small], store)
        turn = torch.cat([out.sequences, text(2, 3), fam.placeholders(large), text(3, 4)], dim=1)
        before = store.stats().hit_tokens
        fam.check(turn, [small, large], store)
        assert store.stats().hit_tokens - before == out.sequences.shape[1] - 1


def test_llava_next_video_image_cached_then_video_in_the_suffix() -> None:
    """LLaVA-NeXT-Video: a video after a cached image is the only medium encoded; a changed video reuses up to it."""
    fam = Family("llava_next_video")
    with served(fam.model, clean=False) as store:
        image = fam.image(1)
        head = torch.cat([text(4, 1), fam.placeholders(image), text(3, 2)], dim=1)
        fam.check(head, [image], store)
        ids = torch.cat([head, run(99, 1), run(VIDEO_ID, 8), text(3, 3)], dim=1)
        for seed, expected in ((1, head.shape[1]), (2, head.shape[1] + 1), (2, ids.shape[1] - 1)):
            kwargs = {**fam.kwargs(ids, [image]), "pixel_values_videos": video_frames(seed)[None]}
            before = store.stats().hit_tokens
            assert_same_as_cold(fam.model, ids, store, new=NEW, suppress_tokens=SPECIAL_IDS, **kwargs)
            assert store.stats().hit_tokens - before == expected
        assert not store.stats().fallbacks
