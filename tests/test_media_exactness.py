"""Vision-language models through the store equal cold runs, and reuse exactly what is the same.

Every request runs cold and through the store (`assert_same_as_cold`: equal tokens, logits
within 1e-4), passing all media every time as a processor would; the store must hand
`generate` only the media of the uncached suffix. Hits are counted in `stats().hit_tokens`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import assert_same_as_cold
from tiny_vlms import (
    IMAGE_ID,
    VISION_END_ID,
    VISION_START_ID,
    cached_vlm,
    llava_next_processor,
    llava_next_tokens,
    llava_pixels,
    pil_image,
    qwen_pixels,
    run,
    text,
)

from hf_prefix_cache import PrefixCache

NEW = 5


class Family:
    """Builds one family's images, their placeholders and the media kwargs of a prompt."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.model = cached_vlm(name)

    def image(self, seed: int) -> Any:
        if self.name == "llava":
            return llava_pixels(seed)
        if self.name == "llava_next":
            sizes = [(30, 60), (50, 40), (32, 32), (64, 20)]
            return pil_image(seed, *sizes[seed % len(sizes)])
        return qwen_pixels(seed, [(1, 4, 6), (1, 2, 4), (1, 4, 4)][seed % 3])

    def placeholders(self, image: Any) -> torch.Tensor:
        if self.name == "llava":
            return run(IMAGE_ID, 16)
        if self.name == "llava_next":
            kw = llava_next_processor()([image], return_tensors="pt")
            (n,) = llava_next_tokens(self.model, kw["pixel_values"], kw["image_sizes"])
            return run(IMAGE_ID, n)
        n = int(image[1].prod()) // 4
        return torch.cat([run(VISION_START_ID, 1), run(IMAGE_ID, n), run(VISION_END_ID, 1)], dim=1)

    def kwargs(self, ids: torch.Tensor, images: list[Any]) -> dict[str, Any]:
        if self.name == "llava":
            return {"pixel_values": torch.stack(images)}
        if self.name == "llava_next":
            return dict(llava_next_processor()(images, return_tensors="pt"))
        return {
            "pixel_values": torch.cat([rows for rows, _ in images]),
            "image_grid_thw": torch.cat([grid for _, grid in images]),
            "mm_token_type_ids": (ids == IMAGE_ID).int(),
        }

    def check(self, ids: torch.Tensor, images: list[Any], store: PrefixCache) -> Any:
        return assert_same_as_cold(self.model, ids, store, new=NEW, **self.kwargs(ids, images))


FAMILIES = ("llava", "llava_next", "qwen2_vl")


@pytest.fixture(params=FAMILIES)
def family(request: pytest.FixtureRequest) -> Iterator[tuple[Family, PrefixCache]]:
    fam = Family(request.param)
    store = PrefixCache(fam.model)
    yield fam, store
    store.check_integrity()
    assert not store.stats().fallbacks, store.stats().fallbacks
    store.detach()


class _Hits:
    def __init__(self, store: PrefixCache) -> None:
        self.store, self.seen = store, 0

    def last(self) -> int:
        now = self.store.stats().hit_tokens
        hit, self.seen = now - self.seen, now
        return hit


def test_second_image_in_the_suffix(family: tuple[Family, PrefixCache]) -> None:
    """A prompt adding a second image after a cached first one reuses the first and encodes only the second."""
    fam, store = family
    hits = _Hits(store)
    img1, img2 = fam.image(1), fam.image(2)
    prefix = torch.cat([text(5, 1), fam.placeholders(img1), text(6, 2)], dim=1)
    fam.check(prefix, [img1], store)
    second = torch.cat([prefix, run(99, 1), text(4, 3), fam.placeholders(img2), text(3, 4)], dim=1)
    fam.check(second, [img1, img2], store)
    assert hits.last() == prefix.shape[1]


def test_changed_first_image_with_identical_tokens(family: tuple[Family, PrefixCache]) -> None:
    """Identical token ids with another first image reuse nothing past that image's start."""
    fam, store = family
    hits = _Hits(store)
    img1, other, img2 = fam.image(1), fam.image(13), fam.image(2)  # seeds 1 and 13: same size, other pixels
    head = text(5, 1)
    ids = torch.cat([head, fam.placeholders(img1), text(6, 2), fam.placeholders(img2), text(3, 4)], dim=1)
    assert torch.equal(fam.placeholders(img1), fam.placeholders(other))
    fam.check(ids, [img1, img2], store)
    fam.check(ids, [other, img2], store)
    assert hits.last() == head.shape[1] + (1 if fam.name == "qwen2_vl" else 0)  # Qwen: vision-start is text
    fam.check(ids, [img1, img2], store)
    assert hits.last() == ids.shape[1] - 1


def test_multi_turn_chat_with_a_new_image_later(family: tuple[Family, PrefixCache]) -> None:
    """Each turn reuses the previous turn's prompt and answer; a new image in turn 2 is the only one encoded."""
    fam, store = family
    hits = _Hits(store)
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
    hits = _Hits(store)
    img1, img2 = fam.image(1), fam.image(2)
    ids = torch.cat([text(3, 1), fam.placeholders(img1), text(2, 2), fam.placeholders(img2), text(4, 3)], dim=1)
    fam.check(ids, [img1, img2], store)
    fam.check(ids, [img1, img2], store)
    assert hits.last() == ids.shape[1] - 1


def test_prompt_ending_in_an_image_never_cuts_inside_it(family: tuple[Family, PrefixCache]) -> None:
    """When the token kept for logits is a placeholder, the reuse stops at that image's start."""
    fam, store = family
    hits = _Hits(store)
    img1, img2 = fam.image(1), fam.image(2)
    head = torch.cat([text(3, 1), fam.placeholders(img1), text(2, 2)], dim=1)
    tail = fam.placeholders(img2)
    if fam.name == "qwen2_vl":
        tail = tail[:, :-1]  # end on the last placeholder, not on vision-end
    ids = torch.cat([head, tail], dim=1)
    fam.check(ids, [img1, img2], store)
    fam.check(ids, [img1, img2], store)
    assert hits.last() == head.shape[1] + (1 if fam.name == "qwen2_vl" else 0)
