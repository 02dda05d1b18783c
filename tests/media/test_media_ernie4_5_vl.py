"""Ernie 4.5 VL through the store equals cold runs and reuses exactly what is the same.

The family suite (`test_media_families.py`) runs its turns and changed media; here: an image
cached then a video in the suffix (only the video encoded), a changed image then the first
again, an exact repeat (no encoder call), requests that leave other `rope_deltas` on the model,
text-only chats, and the expert marks (`moe_mm_token_type_ids`), which route tokens to text or
vision experts: a call without them or with other marks runs cold, counted.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import assert_same_as_cold, generate, max_logit_diff

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.media.ernie4_5_vl import ErnieFamily, Medium
from hf_prefix_cache.testing.media.harness import NEW, SPECIAL_IDS, same_tokens_twice
from hf_prefix_cache.testing.tiny_vlm_media import text

FAMILY = ErnieFamily()
IMAGE, OTHER_IMAGE, VIDEO = Medium("image", 1, (1, 4, 6)), Medium("image", 13, (1, 4, 6)), Medium("video", 5, (2, 4, 4))


class Served:
    """The model, its store, and the hit tokens of the last request."""

    def __init__(self) -> None:
        self.model = FAMILY.model
        self.store = PrefixCache(self.model)
        self._seen = 0

    def check(self, ids: torch.Tensor, media: list[Medium], **extra: Any) -> Any:
        kwargs = {**FAMILY.kwargs(ids, media), "suppress_tokens": SPECIAL_IDS, **extra}
        return assert_same_as_cold(self.model, ids, self.store, new=NEW, **kwargs)

    def hits(self) -> int:
        now = self.store.stats().hit_tokens
        hit, self._seen = now - self._seen, now
        return hit

    def encoded_rows(self, ids: torch.Tensor, media: list[Medium]) -> int:
        """Run through the store only; the patch rows the vision tower saw."""
        seen: list[int] = []

        def record(_module: Any, args: tuple[Any, ...], _out: Any) -> None:
            seen.append(int(args[0].shape[0]))

        handle = self.model.model.vision_tower.register_forward_hook(record)
        try:
            generate(self.model, ids, NEW, past_key_values=self.store, **FAMILY.kwargs(ids, media))
        finally:
            handle.remove()
        return sum(seen)


@pytest.fixture
def ernie() -> Iterator[Served]:
    served = Served()
    yield served
    served.store.check_integrity()
    served.store.detach()


def cat(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts, dim=1)


def test_image_cached_then_video_in_the_suffix(ernie: Served) -> None:
    """A video after a cached image reuses the image; the vision tower sees the video's rows only."""
    head = cat(text(4, 1), FAMILY.placeholders(IMAGE), text(3, 2))
    ernie.check(head, [IMAGE])
    ids = cat(head, text(2, 3), FAMILY.placeholders(VIDEO), text(3, 4))
    ernie.hits()
    ernie.check(ids, [IMAGE, VIDEO])
    assert ernie.hits() == head.shape[1]
    ernie.store.clear()
    ernie.check(head, [IMAGE])
    ernie.hits()
    assert ernie.encoded_rows(ids, [IMAGE, VIDEO]) == 2 * 4 * 4
    assert not ernie.store.stats().fallbacks


def test_changed_image_then_repeat(ernie: Served) -> None:
    """Identical ids with another image reuse nothing past its start; the first image again reuses all, no encoder."""
    head = text(5, 1)
    ids = cat(head, FAMILY.placeholders(IMAGE), text(3, 2), FAMILY.placeholders(VIDEO), text(3, 4))
    ernie.check(ids, [IMAGE, VIDEO])
    ernie.hits()
    ernie.check(ids, [OTHER_IMAGE, VIDEO])
    assert ernie.hits() == head.shape[1] + 1  # the image start id is text
    ernie.check(ids, [IMAGE, VIDEO])
    assert ernie.hits() == ids.shape[1] - 1
    assert ernie.encoded_rows(ids, [IMAGE, VIDEO]) == 0
    assert not ernie.store.stats().fallbacks


def test_stale_rope_deltas_are_never_used(ernie: Served) -> None:
    """After an unrelated request leaves its rope_deltas, a hit with a video in the suffix equals the cold run,
    and a text-only follow-up too; the model's own path on the same restored prefix differs."""
    from transformers import DynamicCache

    model = ernie.model
    head = cat(text(4, 1), FAMILY.placeholders(IMAGE), text(3, 2))
    ids = cat(head, text(2, 3), FAMILY.placeholders(VIDEO), text(3, 4))
    ernie.check(head, [IMAGE])
    other = cat(text(2, 7), FAMILY.placeholders(Medium("image", 2, (1, 2, 4))), text(9, 8))
    generate(model, other, NEW, **FAMILY.kwargs(other, [Medium("image", 2, (1, 2, 4))]))
    stale = model.model.rope_deltas.clone()
    ernie.hits()
    out = ernie.check(ids, [IMAGE, VIDEO])
    assert ernie.hits() == head.shape[1]
    generate(model, other, NEW, **FAMILY.kwargs(other, [Medium("image", 2, (1, 2, 4))]))
    follow = cat(out.sequences, text(4, 9))
    ernie.check(follow, [IMAGE, VIDEO])
    assert ernie.hits() == out.sequences.shape[1] - 1
    # Control: the model's own path on the restored image prefix, with the stale deltas and a text suffix.
    short = cat(head, text(3, 5))
    cold = generate(model, short, NEW, **FAMILY.kwargs(short, [IMAGE]))
    cache = DynamicCache()
    with torch.no_grad():
        model(head, attention_mask=torch.ones_like(head), past_key_values=cache, **FAMILY.kwargs(head, [IMAGE]))
    model.model.rope_deltas = stale
    builtin = generate(model, short, NEW, past_key_values=cache)
    assert max_logit_diff(builtin, cold) > 1e-4
    assert not ernie.store.stats().fallbacks


def test_text_only_chat(ernie: Served) -> None:
    """Text-only prompts are served (explicit positions), turn after turn."""
    turn, previous = text(20, 9), 1
    for i in range(3):
        out = ernie.check(turn, [])
        assert ernie.hits() == previous - 1
        previous = out.sequences.shape[1]
        turn = cat(out.sequences, text(4, 20 + i))
    assert not ernie.store.stats().fallbacks


@pytest.mark.parametrize("marks", ["missing", "other"])
def test_expert_marks_must_be_the_processors(ernie: Served, marks: str) -> None:
    """A call without the expert marks, or with other ones, runs cold with the reason counted."""
    ids = cat(text(4, 1), FAMILY.placeholders(IMAGE), text(3, 2))
    kwargs = {**FAMILY.kwargs(ids, [IMAGE])}
    if marks == "missing":
        del kwargs["moe_mm_token_type_ids"]
    else:
        kwargs["moe_mm_token_type_ids"] = (ids == 120).int()  # placeholders only, not their start/end ids
    same_tokens_twice(ernie.model, ids, ernie.store, **kwargs)
    reason = "moe_mm_token_type_ids_missing" if marks == "missing" else "moe_mm_token_type_ids"
    assert ernie.store.stats().fallbacks == {reason: 2}
    assert ernie.store.stats().hit_tokens == 0
