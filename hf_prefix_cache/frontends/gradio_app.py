"""The Gradio multimodal chat: a conversation on the left, the live cache panel on the right.

Every browser session gets its own conversation (and store session, so its latest turn stays
pinned); all sessions share the engine's one store. Answers stream; after each turn the panel
shows the tokens reused, time to first token cold and cached, bytes per tier and the hit rate,
and, with "compare with a cold run" ticked, the cold answer and whether it is identical.

Install: the ``[gradio]`` extra (``pip install -e '.[gradio]'`` in a clone).
Launch: ``python -m hf_prefix_cache.gradio`` or ``hf-prefix-cache gradio`` (``--model tiny-vlm`` for
images, ``tiny-audio`` for WAV clips,
``--model <hub id or folder>``).
"""

from __future__ import annotations

import html
import uuid
from collections.abc import Iterator
from typing import Any

try:
    import gradio as gr
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("the Gradio app needs gradio: pip install gradio (the [gradio] extra)") from exc

from hf_prefix_cache.api.display import format_nbytes
from hf_prefix_cache.frontends.chat import ChatEngine, Conversation, TurnReport
from hf_prefix_cache.frontends.engines import load_engine as load_engine  # the app loads by name; tests import it here
from hf_prefix_cache.frontends.speedup import speedup_text

TABLE_HEADERS = ["turn", "prompt", "reused", "cold TTFT s", "cached TTFT s", "x", "same"]


def panel_html(report: TurnReport | None, turn: int = 0) -> str:
    """The cache panel for the latest turn (`turn` counts the conversation's finished turns)."""
    if report is None:
        return '<div id="cache-panel" data-turn="0">No turn yet: the panel fills after the first answer.</div>'
    parts = ", ".join(f"{k} {v}" for k, v in sorted(report.reused_by_modality.items())) or "nothing"
    tiers = ", ".join(f"{tier} {format_nbytes(n)}" for tier, n in report.tier_nbytes.items())
    speedup = speedup_text(report.reused_len, report.ttft_cold_s, report.ttft_cached_s, report.fallback)
    lines = [
        f"reused {report.reused_len} of {report.prompt_len} prompt tokens ({parts})",
        f"time to first token: cold {_seconds(report.ttft_cold_s)}, cached {_seconds(report.ttft_cached_s)} "
        f"(speedup: {speedup})",
        f"stored: {tiers}",
        f"hit rate over all sessions: {report.hit_rate:.0%}",
    ]
    if report.fallback:
        lines.append(f"ran cold: {report.fallback}")
    if report.same_as_cold is not None:
        verdict = "identical to" if report.same_as_cold else "DIFFERENT from"
        lines.append(f"the cached answer is {verdict} the cold run's: {report.cold_answer!r}")
    lines += [f"note: {n}" for n in report.notes]
    body = "<br>".join(html.escape(x) for x in lines)
    return f'<div id="cache-panel" data-turn="{turn}"><b>turn {turn}</b>: {body}</div>'


def _seconds(value: float | None) -> str:
    return "not timed" if value is None else f"{value:.3f} s"


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def table_rows(conversation: Conversation) -> list[list[Any]]:
    rows = []
    for i, r in enumerate(conversation.reports, 1):
        speedup = speedup_text(r.reused_len, r.ttft_cold_s, r.ttft_cached_s, r.fallback)
        same = "-" if r.same_as_cold is None else ("yes" if r.same_as_cold else "NO")
        rows.append([i, r.prompt_len, r.reused_len, _rounded(r.ttft_cold_s), _rounded(r.ttft_cached_s), speedup, same])
    return rows


def build_app(engine: ChatEngine, note: str = "") -> gr.Blocks:
    """The Gradio Blocks app over `engine` (call `.launch()` on it).

    Example:
        >>> engine, note = load_engine("tiny-vlm")                    # doctest: +SKIP
        >>> build_app(engine, note).launch()                          # doctest: +SKIP
    """

    def respond(
        message: dict[str, Any], history: list[dict[str, Any]], conversation: Conversation | None, compare: bool
    ) -> Iterator[tuple[Any, ...]]:
        if conversation is None:
            conversation = engine.new_conversation(f"gradio-{uuid.uuid4().hex[:12]}")
        text = (message or {}).get("text") or ""
        files = [f if isinstance(f, str) else f.get("path", "") for f in (message or {}).get("files") or []]
        history = list(history or [])
        if not text and not files:  # an empty submit: nothing to answer
            yield history, gr.skip(), conversation, gr.skip(), gr.skip()
            return
        history += [{"role": "user", "content": {"path": f}} for f in files]
        if text:
            history.append({"role": "user", "content": text})
        history.append({"role": "assistant", "content": ""})
        cleared = gr.MultimodalTextbox(value=None)
        for answer, report in engine.turn(conversation, text, files, compare_cold=bool(compare)):
            history[-1] = {"role": "assistant", "content": answer}
            if report is None:
                yield history, cleared, conversation, gr.skip(), gr.skip()
            else:
                yield (
                    history,
                    cleared,
                    conversation,
                    panel_html(report, len(conversation.reports)),
                    table_rows(conversation),
                )

    def reset(conversation: Conversation | None) -> tuple[Any, ...]:
        if conversation is not None:
            engine.close(conversation)
        return [], None, panel_html(None), []

    title = "hf_prefix_cache chat"
    with gr.Blocks(title=title) as app:
        gr.Markdown(f"## {title}\nModel: {note or type(engine.model).__name__}")
        conversation = gr.State(None)
        with gr.Row():
            with gr.Column(scale=5):
                chatbot = gr.Chatbot(label="conversation", height=420)
                box = gr.MultimodalTextbox(
                    placeholder="Type a message; attach images or audio",
                    file_types=["image", "audio"],
                    file_count="multiple",
                    show_label=False,
                )
                with gr.Row():
                    compare = gr.Checkbox(label="compare with a cold run (proves the answers are identical)")
                    clear = gr.Button("new conversation")
            with gr.Column(scale=4):
                gr.Markdown("### Cache")
                panel = gr.HTML(panel_html(None))
                table = gr.Dataframe(headers=TABLE_HEADERS, label="per turn", interactive=False)
        box.submit(
            respond, [box, chatbot, conversation, compare], [chatbot, box, conversation, panel, table], api_name="chat"
        )
        clear.click(reset, [conversation], [chatbot, conversation, panel, table], api_name="reset")
    blocks: gr.Blocks = app
    return blocks


def main(argv: list[str] | None = None) -> None:
    """Launch the app: ``python -m hf_prefix_cache.gradio [--model NAME] [--port N] [--share]``."""
    from hf_prefix_cache.frontends.args import gradio_parser

    run(gradio_parser().parse_args(argv))


def run(args: Any) -> int:
    """Launch the app for parsed `gradio_parser` arguments; returns when the server stops."""
    engine, note = load_engine(args.model, args.max_new_tokens)
    build_app(engine, note).launch(server_name=args.host, server_port=args.port, share=args.share)
    return 0
