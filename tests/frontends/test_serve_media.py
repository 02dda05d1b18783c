"""Images in chat through `hf-prefix-cache serve`: OpenAI `image_url` data URLs on a tiny LLaVA with a real processor.

Our server and `transformers serve` (no store) serve the same saved tiny LLaVA; every answer at
temperature 0 must be equal, and the next turn must reuse the stored image's prefix.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.serve_server import ServeProcess, image_url, tiny_vlm_folder

NEW = 5


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, ServeProcess, str]]:
    from hf_prefix_cache.api.models import ModelUnavailableError

    try:
        folder = tiny_vlm_folder(Path(tmp_path_factory.mktemp("tiny-llava")))
    except ModelUnavailableError as exc:
        pytest.skip(f"the tiny VLM needs SmolLM2's tokenizer: {exc}")
    ours, shipped = ServeProcess(folder), ServeProcess(folder, ours=False)
    try:
        yield ours.wait(), shipped.wait(), folder
    finally:
        ours.stop()
        shipped.stop()


def _turn(server: ServeProcess, model: str, messages: list[dict[str, Any]], stream: bool = False) -> tuple[str, Any]:
    client = server.client()
    if not stream:
        response = client.chat.completions.create(model=model, messages=messages, max_tokens=NEW, temperature=0)
        return response.choices[0].message.content, response.usage
    text, usage = [], None
    for chunk in client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=NEW,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    return "".join(text), usage


def _image_turn(seed: int, text: str) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": image_url(seed)}}, {"type": "text", "text": text}],
    }


def test_the_next_turn_reuses_the_stored_image_exactly(servers: tuple[ServeProcess, ServeProcess, str]) -> None:
    """Turn 2 after an image turn reuses the whole first prompt, image placeholders included; answers equal transformers'."""
    ours, shipped, model = servers
    messages: list[dict[str, Any]] = [_image_turn(1, "Describe the picture.")]
    first, first_usage = _turn(ours, model, messages)
    assert first == _turn(shipped, model, messages)[0]
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "What colour dominates?"}]
    second, usage = _turn(ours, model, messages, stream=True)
    assert second == _turn(shipped, model, messages)[0]
    assert first_usage.prompt_tokens <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    stats = ours.store(check=True)
    assert stats["integrity"] == "ok"
    assert stats["stats"]["hit_tokens_by_modality"].get("image", 0) == 16  # 16 placeholders per 32x32 image


def test_another_image_at_the_same_place_is_not_reused(servers: tuple[ServeProcess, ServeProcess, str]) -> None:
    """The same words with a different image reuse at most the text before the image, and answer as transformers does."""
    ours, shipped, model = servers
    ours_first, _ = _turn(ours, model, [_image_turn(2, "Is there a cat?")])
    other = [_image_turn(3, "Is there a cat?")]
    answer, usage = _turn(ours, model, other)
    assert answer == _turn(shipped, model, other)[0]
    assert usage.prompt_tokens_details.cached_tokens <= 3  # "<|im_start|>user\n": the image comes right after
    assert ours_first == _turn(shipped, model, [_image_turn(2, "Is there a cat?")])[0]
