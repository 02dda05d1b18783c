"""integrations/gradio: the ChatInterface recipe, driven by gradio_client, reuses earlier turns and answers as plain generate."""

from __future__ import annotations

import re
import socket

from hf_prefix_cache import PrefixCache, load_smollm2
from integrations_tools.examples import example, require, smollm2_dir

require("gradio", "gradio_client", install="pip install -e '.[gradio]'")

TURNS = ("Name a colour.", "Another one?", "And a third?")
NEW = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_chat_interface_reuses_every_earlier_turn_and_answers_as_generate_without_the_store() -> None:
    """Through gradio_client, turns 2 and 3 report reusing at least the previous prompt; answers equal a cold generate."""
    from gradio_client import Client

    smollm2_dir()
    recipe = example("gradio/chat_interface.py")
    model, tokenizer = load_smollm2()
    store = PrefixCache(model)
    demo = recipe.build_demo(model, tokenizer, store, max_new_tokens=NEW)
    port = _free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)  # one session: the server keeps its history
        replies = [client.predict(question, api_name="/respond") for question in TURNS]
    finally:
        demo.close()
    store.detach()

    reused = [tuple(map(int, re.findall(r"[\d,]+", panel.replace(",", "")))) for _answer, panel in replies]
    assert reused[0][0] == 0
    for (_, before), (hit, _after) in zip(reused, reused[1:], strict=False):
        assert hit >= before, reused  # the whole previous prompt, and more
    assert store.stats().hit_tokens == sum(hit for hit, _ in reused)

    messages: list[dict[str, str]] = []
    for question, (answer, _panel) in zip(TURNS, replies, strict=True):
        messages.append({"role": "user", "content": question})
        inputs = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
        out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)  # no store: a cold run
        cold = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
        assert answer == cold, (question, answer, cold)
        messages.append({"role": "assistant", "content": answer})
