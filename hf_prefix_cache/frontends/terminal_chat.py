"""`hf-prefix-cache chat [MODEL]`: a streamed chat in the terminal, each turn reusing the ones before.

A thin loop over `ChatEngine` (the Gradio app's engine): it reads a line, streams the answer as
it is generated, and ends each turn with one line of what the store did: the prompt tokens
reused (by modality) and the time to first token. ``--compare-cold`` also runs each turn
without the store and says whether the answer is identical. Commands: ``/image PATH`` and
``/audio PATH`` attach a file to the next message (for a model that takes it), ``/new`` starts
a new conversation, ``/help``, ``/quit`` (or end of input). Input may be piped: each line is a
message or a command, echoed so that a transcript reads as a chat.

Example:
    >>> chat_loop(engine, ["Hello!", "/quit"])                          # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterable, Iterator

from hf_prefix_cache.frontends.chat import ChatEngine, Conversation, TurnReport
from hf_prefix_cache.frontends.engines import TINY_VLM, load_engine
from hf_prefix_cache.frontends.speedup import speedup_text

COMMANDS = """commands:
  /image PATH   attach an image to your next message (a vision-language model)
  /audio PATH   attach a WAV clip to your next message (an audio model)
  /new          start a new conversation (the store keeps what it holds)
  /help         this list
  /quit         leave (or Ctrl-D)"""


def report_line(report: TurnReport, timed_cold: bool) -> str:
    """The line printed after an answer: tokens reused, time to first token, and the cold comparison.

    Example:
        >>> from hf_prefix_cache.frontends.chat import TurnReport
        >>> r = TurnReport(40, 32, {"text": 32}, 0.05, None, {}, 0.5)
        >>> report_line(r, timed_cold=False)
        '[reused 32 of 40 prompt tokens (text 32); first token in 0.05 s]'
    """
    parts = ", ".join(f"{k} {v}" for k, v in sorted(report.reused_by_modality.items()) if v)
    reused = f"reused {report.reused_len} of {report.prompt_len} prompt tokens" + (f" ({parts})" if parts else "")
    fields = [reused, f"first token in {report.ttft_cached_s:.2f} s"]
    if timed_cold and report.ttft_cold_s is not None:
        speedup = speedup_text(report.reused_len, report.ttft_cold_s, report.ttft_cached_s, report.fallback)
        fields.append(f"cold {report.ttft_cold_s:.2f} s, speedup {speedup}")
    elif report.fallback:
        fields.append(f"ran cold: {report.fallback}")
    if report.same_as_cold is not None:
        fields.append("identical to cold: " + ("yes" if report.same_as_cold else "NO"))
    fields += [f"note: {n}" for n in report.notes]
    return "[" + "; ".join(fields) + "]"


def _new_conversation(engine: ChatEngine, number: int, system: str | None) -> Conversation:
    conversation = engine.new_conversation(f"terminal-{os.getpid()}-{number}")
    if system:
        conversation.messages.append({"role": "system", "content": [{"type": "text", "text": system}]})
    return conversation


def chat_loop(
    engine: ChatEngine,
    lines: Iterable[str],
    *,
    system: str | None = None,
    compare_cold: bool = False,
    echo: bool = False,
) -> list[TurnReport]:
    """Hold a chat over `lines` (messages and commands), printing answers as they stream; returns each turn's report.

    Args:
        engine: the model, its processor and the store.
        lines: what the user types, one message or command per item.
        system: a system prompt opening every conversation.
        compare_cold: also run each turn without the store (its time, and whether the answer is identical).
        echo: print each line as the user's turn (for piped input, so the output reads as a chat).
    """
    number = 1
    conversation = _new_conversation(engine, number, system)
    attached: list[str] = []
    reports: list[TurnReport] = []
    try:
        for raw in lines:
            line = raw.strip()
            if not line:
                continue
            if echo:
                print(f"you: {line}")
            if line.startswith("/"):
                command, _, argument = line.partition(" ")
                argument = os.path.expanduser(argument.strip())
                if command in ("/quit", "/exit"):
                    break
                if command == "/help":
                    print(COMMANDS)
                elif command == "/new":
                    engine.close(conversation)
                    number += 1
                    conversation = _new_conversation(engine, number, system)
                    attached = []
                    print("(a new conversation)")
                elif command in ("/image", "/audio"):
                    if not argument or not os.path.isfile(argument):
                        print(f"{command}: no file {argument!r}; give the path of a file")
                    else:
                        attached.append(argument)
                        print(f"(attached {os.path.basename(argument)} to your next message)")
                else:
                    print(f"unknown command {command}; /help lists them")
                continue
            report = _turn(engine, conversation, line, attached, compare_cold)
            attached = []
            reports.append(report)
    except KeyboardInterrupt:
        print()
    finally:
        engine.close(conversation)
    return reports


def _turn(
    engine: ChatEngine, conversation: Conversation, text: str, files: list[str], compare_cold: bool
) -> TurnReport:
    print("assistant: ", end="", flush=True)
    shown = ""
    for answer, report in engine.turn(conversation, text, files, compare_cold=compare_cold, time_cold=compare_cold):
        if report is None:
            print(answer[len(shown) :], end="", flush=True)
            shown = answer
            continue
        rest = answer[len(shown) :] if answer.startswith(shown) else ""
        print(rest)
        print(report_line(report, timed_cold=compare_cold), flush=True)
        return report
    raise AssertionError("ChatEngine.turn ends with a report")


def _typed_lines() -> Iterator[str]:
    with contextlib.suppress(ImportError):  # not on every platform
        import readline  # noqa: F401  (line editing and history for input())
    while True:
        try:
            yield input("you: ")
        except EOFError:
            print()
            return


def run(args: argparse.Namespace) -> int:
    """Run the chat for parsed `args.chat_parser` arguments; returns the exit status."""
    name = TINY_VLM if args.tiny else args.model
    engine, note = load_engine(name, args.max_new_tokens)
    first_sentence = note.replace("**", "").split(". ")[0].rstrip(".")
    print(f"{first_sentence}. Type /help for commands, /quit to leave.")
    interactive = sys.stdin.isatty()
    try:
        chat_loop(
            engine,
            _typed_lines() if interactive else sys.stdin,
            system=args.system,
            compare_cold=args.compare_cold,
            echo=not interactive,
        )
    finally:
        engine.store.detach()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m hf_prefix_cache.frontends.terminal_chat [MODEL]``: the same as ``hf-prefix-cache chat``."""
    from hf_prefix_cache.frontends.args import chat_parser

    return run(chat_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
