"""The store through transformers' front doors: chat pipelines (text and image-text-to-text), streamers, and a device_map="auto" model.

Each case runs cold and through the store, compares the outputs, and counts the reused tokens.
"""

from __future__ import annotations

import copy
import io
import threading
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import Hits, assert_same_as_cold, cached_model, distinct_prompt
from PIL import Image
from transformers import AutoModelForCausalLM, TextIteratorStreamer, TextStreamer, pipeline

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.api.models import load_smollm2
from hf_prefix_cache.frontends.tiny_vlm import load_tiny_vlm

CHAT = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name three colours."},
]
GREEDY = {"max_new_tokens": 8, "do_sample": False}
# Every front door takes the store under both names, on transformers 5.23 and 5.24 alike.
BOTH_NAMES = pytest.mark.parametrize("name", ["cache", "past_key_values"])


@pytest.fixture(scope="module")
def smollm2() -> tuple[Any, Any]:
    return load_smollm2()


@pytest.fixture(scope="module")
def tiny_vlm() -> tuple[Any, Any]:
    return load_tiny_vlm()


@BOTH_NAMES
def test_text_generation_pipeline_chat_reuses_the_previous_turn(smollm2: tuple[Any, Any], name: str) -> None:
    """A chat through pipeline("text-generation") on SmolLM2 equals the cold pipeline, and turn 2 reuses turn 1's prompt."""
    model, tokenizer = smollm2
    store = PrefixCache(model)
    try:
        chat = pipeline("text-generation", model=model, tokenizer=tokenizer)
        hits = Hits(store)
        first_cold = chat(CHAT, **GREEDY)
        first = chat(CHAT, **{name: store}, **GREEDY)
        assert first == first_cold and hits.last() == 0
        follow_up = [*first[0]["generated_text"], {"role": "user", "content": "And three fruits?"}]
        second_cold = chat(follow_up, **GREEDY)
        second = chat(follow_up, **{name: store}, **GREEDY)
        assert second == second_cold
        first_prompt_len = len(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True))
        assert hits.last() >= first_prompt_len
    finally:
        store.detach()


@BOTH_NAMES
def test_image_text_to_text_pipeline_reuses_the_image(tiny_vlm: tuple[Any, Any], name: str) -> None:
    """pipeline("image-text-to-text") with the store equals the cold pipeline; a follow-up reuses the image's 16 placeholders."""
    model, processor = tiny_vlm
    store = PrefixCache(model)
    image = Image.fromarray((np.random.default_rng(0).random((40, 48, 3)) * 255).astype(np.uint8))
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Describe it."}]}
    ]
    try:
        pipe = pipeline("image-text-to-text", model=model, processor=processor)
        cold = pipe(text=messages, generate_kwargs=GREEDY)
        warm = pipe(text=messages, generate_kwargs={**GREEDY, name: store})
        assert warm == cold
        messages += [
            {"role": "assistant", "content": [{"type": "text", "text": warm[0]["generated_text"][-1]["content"]}]},
            {"role": "user", "content": [{"type": "text", "text": "Again?"}]},
        ]
        cold = pipe(text=messages, generate_kwargs=GREEDY)
        warm = pipe(text=messages, generate_kwargs={**GREEDY, name: store})
        assert warm == cold
        stats = store.stats()
        assert stats.hit_tokens_by_modality.get("image") == 16 and not stats.fallbacks
    finally:
        store.detach()


@BOTH_NAMES
def test_text_streamer_prints_the_cold_text_on_a_hit(smollm2: tuple[Any, Any], name: str) -> None:
    """TextStreamer prints the same answer through the store (on a hit) as cold."""
    model, tokenizer = smollm2
    store = PrefixCache(model)
    inputs = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)

    def streamed(**kwargs: Any) -> str:
        buffer = io.StringIO()
        with redirect_stdout(buffer):
            model.generate(**inputs, streamer=TextStreamer(tokenizer, skip_prompt=True), **GREEDY, **kwargs)
        return buffer.getvalue()

    try:
        cold = streamed()
        streamed(**{name: store})
        hits = Hits(store)
        assert streamed(**{name: store}) == cold
        assert hits.last() == inputs["input_ids"].shape[1] - 1
        assert cold.strip()
    finally:
        store.detach()


@BOTH_NAMES
def test_text_iterator_streamer_on_a_thread_yields_the_cold_text(smollm2: tuple[Any, Any], name: str) -> None:
    """TextIteratorStreamer with generate on a thread yields the cold answer, chunk by chunk, on a hit."""
    model, tokenizer = smollm2
    store = PrefixCache(model)
    inputs = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    cold = model.generate(**inputs, **GREEDY)
    expected = tokenizer.decode(cold[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    try:
        model.generate(**inputs, **{name: store}, **GREEDY)
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        thread = threading.Thread(target=model.generate, kwargs={**inputs, **GREEDY, "streamer": streamer, name: store})
        thread.start()
        chunks = list(streamer)
        thread.join()
        assert "".join(chunks) == expected and len(chunks) > 1
        assert store.stats().hit_tokens == inputs["input_ids"].shape[1] - 1
    finally:
        store.detach()


def test_device_map_auto_model_equals_cold(tmp_path: Path) -> None:
    """A device_map="auto" model whose layers accelerate offloads to disk (its hooks load weights per forward) is served exactly and reuses a repeated prompt.

    On a CPU-only machine plain "auto" puts everything on the CPU without hooks; the small
    memory cap makes accelerate place most layers on disk, so its hooks really run.
    """
    folder = tmp_path / "llama"
    # A copy: save_pretrained writes `architectures` into the config it saves, and the shared model's config
    # is part of its namespace (a later test in another process builds it afresh and must match it).
    copy.deepcopy(cached_model("llama")).save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(
        folder, device_map="auto", max_memory={"cpu": 200_000}, offload_folder=tmp_path / "offload", dtype=torch.float32
    ).eval()
    assert "disk" in model.hf_device_map.values(), model.hf_device_map
    model.generation_config.eos_token_id = None
    store = PrefixCache(model)
    try:
        ids = distinct_prompt(7, 24).to(model.device)
        assert_same_as_cold(model, ids, store)
        hits = Hits(store)
        assert_same_as_cold(model, ids, store)
        assert hits.last() == 23
    finally:
        store.detach()
