"""Random conversations of text and images through a tiny LLaVA, Qwen2-VL (M-RoPE) and Gemma 3
(image blocks attending both ways, sliding-window layers):
every request equals its cold run, and reuses exactly what a reference model of the rules
predicts.

The reference keys each prompt position by its token, or by (image, index in the image) for a
placeholder; a request reuses the longest common prefix with any stored sequence (prompt plus
answer minus its last token), capped at all but the last prompt token and moved back to the
start of an image it would cut. Images come from a pool of three, texts from a pool of four
tokens, so prompts share prefixes often, and the same placeholders often stand for other
pictures.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import pytest
import torch
from conftest import assert_same_as_cold
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_vlms import BOI_ID, EOI_ID, IMAGE_ID, VISION_END_ID, VISION_START_ID, cached_vlm, llava_pixels, qwen_pixels

from hf_prefix_cache import PrefixCache

NEW = 3
SUPPRESS = list(range(100, 128))  # answers never contain placeholder or special ids
NUM_IMAGES = 3
LLAVA_POOL = [llava_pixels(seed) for seed in range(NUM_IMAGES)]  # 16 placeholders each (Gemma 3: 4)
QWEN_POOL = [qwen_pixels(seed) for seed in range(NUM_IMAGES)]  # grid (1, 4, 6): 6 placeholders each

# A prompt piece: a few text tokens, or the index of an image in POOL.
pieces = st.one_of(st.lists(st.integers(4, 7), min_size=1, max_size=4), st.integers(0, NUM_IMAGES - 1))
# A request: its new pieces, and whether it continues the previous answer (a chat turn).
requests = st.lists(st.tuples(st.lists(pieces, min_size=1, max_size=4), st.booleans()), min_size=1, max_size=4)


class Prompt:
    """Token ids, the images in order, and the reference symbol of every position."""

    def __init__(self, family: str) -> None:
        self.family = family
        self.ids: list[int] = []
        self.images: list[int] = []
        self.symbols: list[Hashable] = []
        self.spans: list[tuple[int, int]] = []

    def add_text(self, tokens: list[int]) -> None:
        self.ids += tokens
        self.symbols += tokens

    def add_image(self, index: int) -> None:
        framing, per_image = {"qwen2_vl": ((VISION_START_ID, VISION_END_ID), 6), "gemma3": ((BOI_ID, EOI_ID), 4)}.get(
            self.family, ((), 16)
        )
        if framing:
            self.add_text([framing[0]])
        start = len(self.ids)
        self.ids += [IMAGE_ID] * per_image
        self.symbols += [("image", index, i) for i in range(per_image)]
        self.spans.append((start, start + per_image))
        self.images.append(index)
        if framing:
            self.add_text([framing[1]])

    def continued(self, answer: list[int]) -> Prompt:
        """This prompt followed by `answer` (the next chat turn starts so)."""
        out = Prompt(self.family)
        out.ids, out.images, out.symbols, out.spans = (
            list(self.ids),
            list(self.images),
            list(self.symbols),
            list(self.spans),
        )
        out.add_text(answer)
        return out

    def kwargs(self) -> dict[str, Any]:
        if not self.images:
            return {}
        if self.family == "qwen2_vl":
            rows, grids = zip(*(QWEN_POOL[i] for i in self.images), strict=True)
            # As the processor returns them: the grids, and 1 marking each image placeholder.
            marks = (torch.tensor([self.ids]) == IMAGE_ID).int()
            return {"pixel_values": torch.cat(rows), "image_grid_thw": torch.cat(grids), "mm_token_type_ids": marks}
        pixels = torch.stack([LLAVA_POOL[i] for i in self.images])
        if self.family == "gemma3":
            return {"pixel_values": pixels, "token_type_ids": (torch.tensor([self.ids]) == IMAGE_ID).int()}
        return {"pixel_values": pixels}


def expected_reuse(prompt: Prompt, stored: list[list[Hashable]]) -> int:
    best = 0
    for seq in stored:
        n = 0
        while n < min(len(seq), len(prompt.symbols)) and seq[n] == prompt.symbols[n]:
            n += 1
        best = max(best, n)
    cut = min(best, len(prompt.ids) - 1)
    for start, end in prompt.spans:
        if start < cut < end:
            cut = start
    return cut


@pytest.mark.parametrize("family", ["llava", "qwen2_vl", "gemma3"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversation=requests)
def test_random_conversations_reuse_exactly_what_the_rules_allow(family: str, conversation: list[Any]) -> None:
    model = cached_vlm(family)
    store = PrefixCache(model)
    stored: list[list[Hashable]] = []
    previous: tuple[Prompt, list[int]] | None = None
    try:
        for new_pieces, continues in conversation:
            prompt = previous[0].continued(previous[1]) if continues and previous is not None else Prompt(family)
            for piece in new_pieces:
                prompt.add_image(piece) if isinstance(piece, int) else prompt.add_text(piece)
            ids = torch.tensor([prompt.ids])
            before = store.stats().hit_tokens
            out = assert_same_as_cold(model, ids, store, new=NEW, suppress_tokens=SUPPRESS, **prompt.kwargs())
            assert store.stats().hit_tokens - before == expected_reuse(prompt, stored)
            answer = out.sequences[0, ids.shape[1] :].tolist()
            stored.append(prompt.symbols + answer[:-1])
            previous = (prompt, answer)
        assert not store.stats().fallbacks, store.stats().fallbacks
        store.check_integrity()
    finally:
        store.detach()
