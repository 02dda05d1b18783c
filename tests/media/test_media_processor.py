"""A three-turn chat with images driven by real processors: every turn equals a cold run and reuses the last.

The processors are built offline (real image processor classes, a BPE tokenizer trained in
the test session, a chat template) and called as users do:
`processor.apply_chat_template(messages, ...)`, then `model.generate(**inputs, past_key_values=store)`,
passing every image of the conversation each turn.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import assert_same_as_cold

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.tiny_processors import llava_processor, qwen2_vl_processor
from hf_prefix_cache.testing.tiny_vlm_media import pil_image
from hf_prefix_cache.testing.tiny_vlms import cached_vlm

PROCESSORS = {"llava": llava_processor, "qwen2_vl": qwen2_vl_processor}


@pytest.mark.parametrize("name", sorted(PROCESSORS))
def test_three_turn_chat_through_the_processor(name: str) -> None:
    """Turn 2 adds an image and reuses turn 1 with its image; turn 3 (text) reuses both images."""
    model, processor = cached_vlm(name), PROCESSORS[name]()
    store = PrefixCache(model)
    turns: list[list[dict[str, Any]]] = [
        [{"type": "image", "image": pil_image(1, 40, 50)}, {"type": "text", "text": "what is in the image"}],
        [{"type": "image", "image": pil_image(2, 32, 24)}, {"type": "text", "text": "and now compare both pictures"}],
        [{"type": "text", "text": "tell me more about the colours"}],
    ]
    messages: list[dict[str, Any]] = []
    previous_prompt_len = 0
    try:
        for i, content in enumerate(turns):
            messages.append({"role": "user", "content": content})
            inputs = dict(
                processor.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
                )
            )
            ids = inputs.pop("input_ids")
            num_images = sum(1 for turn in turns[: i + 1] for c in turn if c["type"] == "image")
            per_image = inputs["pixel_values"] if name == "llava" else inputs["image_grid_thw"]
            assert per_image.shape[0] == num_images  # all images of the conversation, every turn
            before = store.stats().hit_tokens
            out = assert_same_as_cold(model, ids, store, new=6, **inputs)
            hit = store.stats().hit_tokens - before
            # Everything of the last prompt (images included) comes back; the re-tokenised answer may differ.
            assert hit >= previous_prompt_len if i else hit == 0
            previous_prompt_len = ids.shape[1]
            answer = processor.tokenizer.decode(out.sequences[0, ids.shape[1] :], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": answer})
        stats = store.stats()
        assert not stats.fallbacks and stats.hit_requests == 2
        store.check_integrity()
    finally:
        store.detach()


def test_processor_prompts_contain_their_images() -> None:
    """Sanity check of the offline processors: placeholders expand per image and ids fit the tiny vocabulary."""
    for name, make in PROCESSORS.items():
        processor = make()
        messages = [{"role": "user", "content": [{"type": "image", "image": pil_image(3, 20, 28)}]}]
        inputs = processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
        )
        ids = inputs["input_ids"]
        assert int(ids.max()) < cached_vlm(name).config.get_text_config().vocab_size
        assert int((ids == 120).sum()) > 1, name
        assert torch.is_tensor(inputs["pixel_values"])
