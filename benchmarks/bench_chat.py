"""Chat time-to-first-token per turn on the real SmolLM2-135M-Instruct: cold against through the store.

The conversation: a system prompt (``--system-repeats`` copies of a bakery description, about
65 tokens each) and ``--turns`` user questions, each answered greedily with
``--new-tokens`` tokens through `hf_prefix_cache.frontends.chat.ChatEngine`, the engine of the
Gradio app. Per turn the engine measures:

* ``cold``: ``model.generate(**inputs, max_new_tokens=1)`` without the store (the whole
  conversation prefilled: the time to the first token);
* ``cached``: the streamed answer through the store (a session per conversation) until the
  first new token reaches the `TextIteratorStreamer`; the store holds the previous turn.

The conversation runs ``--reps`` times, each with a fresh store; the table shows per-turn
medians and ``cold/cached``. The first repetition also runs each answer cold in full and
checks the tokens are identical (``same``). ``--plot PATH`` draws the medians (matplotlib);
``--json PATH`` writes them.

Run: ``PYTHONPATH=. python benchmarks/bench_chat.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from _common import print_end, print_environment, start_run

from hf_prefix_cache.api.models import load_smollm2
from hf_prefix_cache.frontends.chat import ChatEngine

SYSTEM = (
    "The Sunny Corner bakery sells bread, croissants, cakes and coffee. It opens at 7 and closes at 19, "
    "except on Sundays, when it opens at 8 and closes at 13. Orders for birthday cakes need two days' notice. "
)
QUESTIONS = [
    "When do you open?",
    "And on Sundays?",
    "Do you sell coffee?",
    "Can I order a cake for tomorrow?",
    "What bread do you recommend?",
    "Thank you, goodbye!",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--turns", type=int, default=6, help=f"user turns (at most {len(QUESTIONS)}, default 6)")
    p.add_argument("--system-repeats", type=int, default=12, help="copies of the system text (default 12)")
    p.add_argument("--new-tokens", type=int, default=24, help="answer tokens per turn (default 24)")
    p.add_argument("--reps", type=int, default=3, help="conversations, each with a fresh store (default 3)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--plot", metavar="PATH", help="write the per-turn plot as a PNG")
    p.add_argument("--json", metavar="PATH", help="write the per-turn medians as JSON")
    p.add_argument("--quick", action="store_true", help="2 turns, a short system prompt, 1 repetition (smoke run)")
    args = p.parse_args()
    if args.quick:
        args.turns, args.system_repeats, args.new_tokens, args.reps = 2, 2, 4, 1
    started = start_run(args.threads)
    model, tokenizer = load_smollm2()
    print_environment(", SmolLM2-135M-Instruct float32 on CPU")
    system = "You answer questions about the bakery in one short sentence. " + SYSTEM * args.system_repeats
    cold: list[list[float]] = [[] for _ in range(args.turns)]
    cached: list[list[float]] = [[] for _ in range(args.turns)]
    prompt_lens = [0] * args.turns
    reused = [0] * args.turns
    same: list[bool | None] = [None] * args.turns
    for rep in range(args.reps):
        engine = ChatEngine(model, tokenizer, max_new_tokens=args.new_tokens)
        chat = engine.new_conversation(f"bench-{rep}")
        chat.messages.append({"role": "system", "content": [{"type": "text", "text": system}]})
        for turn, question in enumerate(QUESTIONS[: args.turns]):
            _, report = list(engine.turn(chat, question, compare_cold=rep == 0))[-1]
            assert report is not None
            cold[turn].append(report.ttft_cold_s)
            cached[turn].append(report.ttft_cached_s)
            prompt_lens[turn], reused[turn] = report.prompt_len, report.reused_len
            if rep == 0:
                same[turn] = report.same_as_cold
        engine.store.detach()
    rows = []
    print(f"\n{'turn':>4s}  {'prompt':>6s}  {'reused':>6s}  {'cold s':>7s}  {'cached s':>8s}  cold/cached  same")
    for t in range(args.turns):
        c, w = statistics.median(cold[t]), statistics.median(cached[t])
        rows.append(
            {
                "turn": t + 1,
                "prompt_len": prompt_lens[t],
                "reused_len": reused[t],
                "cold_s": c,
                "cached_s": w,
                "same": same[t],
            }
        )
        print(f"{t + 1:4d}  {prompt_lens[t]:6d}  {reused[t]:6d}  {c:7.3f}  {w:8.3f}  {c / w:11.2f}  {same[t]}")
    if any(s is False for s in same):
        raise SystemExit("a cached answer differs from its cold run: please report this")
    if args.json:
        Path(args.json).write_text(json.dumps({"reps": args.reps, "turns": rows}, indent=2) + "\n")
    if args.plot:
        _plot(rows, args.plot, args.reps)
    print_end(started, newline=True)


def _plot(rows: list[dict[str, object]], path: str, reps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [int(str(r["turn"])) for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    ax.bar([t - 0.2 for t in turns], [float(str(r["cold_s"])) for r in rows], width=0.4, label="cold", color="#c44e52")
    ax.bar(
        [t + 0.2 for t in turns],
        [float(str(r["cached_s"])) for r in rows],
        width=0.4,
        label="through the store",
        color="#4c9f70",
    )
    for t, r in zip(turns, rows, strict=True):
        ax.annotate(
            f"{r['reused_len']}/{r['prompt_len']}", (t, float(str(r["cold_s"]))), ha="center", va="bottom", fontsize=8
        )
    ax.set_xticks(turns)
    ax.set_xlabel("chat turn (labels: reused / prompt tokens)")
    ax.set_ylabel("time to first token, s")
    ax.set_title(f"SmolLM2-135M-Instruct on CPU, median of {reps}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
