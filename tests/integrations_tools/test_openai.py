"""integrations/openai: the openai client's streamed turns against `hf-prefix-cache serve` report reuse, and salts keep it apart."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from hf_prefix_cache import load_smollm2
from integrations_tools.examples import example, require, smollm2_dir

require("openai", install="pip install openai")
require("fastapi", install="pip install -e '.[serve]'")

from hf_prefix_cache._compat import serve_requirement  # noqa: E402

if serve_requirement() is not None:  # hf-prefix-cache serve needs transformers >= 5.25
    pytest.skip(serve_requirement(), allow_module_level=True)

NEW = 12


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    from hf_prefix_cache.testing.serve_process import ServeProcess

    process = ServeProcess(smollm2_dir(), name="integrations-openai")
    try:
        yield process.wait()
    finally:
        process.stop()


def test_streamed_turns_report_cached_tokens_answer_as_a_cold_generate_and_a_salt_reuses_only_its_own(
    server: Any,
) -> None:
    """Turns 2-3 report at least the previous prompt cached; answers equal a local cold generate; another salt gets 0."""
    recipe = example("openai/client.py")
    client = server.client()
    model_name = client.models.list().data[0].id
    streamed: list[str] = []
    turns = list(recipe.chat(client, model_name, salt="tenant-a", max_tokens=NEW, on_text=streamed.append))

    assert "".join(streamed) == "".join(turn.answer for turn in turns)
    assert turns[0].cached_tokens == 0, turns  # a salt nobody used yet starts empty
    for before, after in zip(turns, turns[1:], strict=False):
        assert after.cached_tokens >= before.prompt_tokens, turns

    other = list(recipe.chat(client, model_name, recipe.TURNS[:1], salt="tenant-b", max_tokens=NEW))
    assert other[0].cached_tokens == 0 and other[0].answer == turns[0].answer  # same prompt, other tenant: no reuse
    again = list(recipe.chat(client, model_name, recipe.TURNS[:1], salt="tenant-a", max_tokens=NEW))
    assert again[0].cached_tokens == again[0].prompt_tokens - 1  # the same tenant reuses all but the last token

    model, tokenizer = load_smollm2()  # the same conversation, generated here without any store
    messages = [{"role": "system", "content": recipe.SYSTEM}]
    for question, turn in zip(recipe.TURNS, turns, strict=True):
        messages.append({"role": "user", "content": question})
        inputs = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
        assert turn.prompt_tokens == inputs["input_ids"].shape[1]
        out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
        assert turn.answer == tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True), (
            question
        )
        messages.append({"role": "assistant", "content": turn.answer})
