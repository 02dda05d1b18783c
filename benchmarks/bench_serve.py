"""Serving through the `openai` client: `transformers serve` as shipped, with `--continuous-batching`, and ours.

Three servers of the real SmolLM2-135M-Instruct run side by side on free loopback ports, each
process limited to ``--threads`` threads (``OMP_NUM_THREADS``); they are measured one at a time.

* **Time to first token per turn.** One chat: a system prompt of about ``--system-tokens``
  tokens (the handbook of `frontends/sample_text.py`, repeated) and ``--turns`` questions,
  each answered greedily (temperature 0) with ``--new-tokens`` tokens, streamed. The client
  times each request from sending it to the first chunk with answer text (transformers sends
  an empty role chunk first, which does not count). ``cached`` is our server's
  ``usage.prompt_tokens_details.cached_tokens``; ``same`` says whether every server's answer
  text equals the shipped server's.
* **Requests per second.** ``--chats`` conversations at once (same system prompt, their own
  questions), ``--chat-turns`` turns each, from one client thread per chat; requests finished
  over wall time.

Prints one table with the ratios (``shipped/ours``, ``cb/ours``), writes ``--plot`` (PNG) and
``--json``. A server that fails to start or to answer is reported, not fatal.

Run: ``PYTHONPATH=. python benchmarks/bench_serve.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from _common import print_end, print_environment, start_run, system_prompt

from hf_prefix_cache.api.models import smollm2_folder
from hf_prefix_cache.api.sample_text import FOLLOW_UPS, QUESTIONS
from hf_prefix_cache.testing.serve_process import ServeProcess

#: Each server: whether it is ours, and the arguments after the model.
SERVERS = {"shipped": (False, ()), "cb": (False, ("--continuous-batching",)), "ours": (True, ())}


class Server:
    """One server process on a free loopback port; `error` says why it is unusable, if it is."""

    def __init__(self, name: str, model: str, threads: int) -> None:
        ours, args = SERVERS[name]
        self.name = name
        self.error: str | None = None
        env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        self.process = ServeProcess(model, *args, ours=ours, env=env, name=f"bench-serve-{name}")

    def wait(self, timeout: float = 300) -> None:
        try:
            self.process.wait(timeout)
        except RuntimeError:
            self.error = f"did not start ({self.process.tail(600).replace(chr(10), ' | ')})"

    def client(self) -> Any:
        return self.process.client(timeout=600)

    def stop(self) -> None:
        self.process.stop()


def streamed_turn(client: Any, model: str, messages: list[dict[str, str]], new: int) -> tuple[float, str, int]:
    """Seconds to the first answer text, the answer, and the cached prompt tokens the server reported."""
    start = time.perf_counter()
    first: float | None = None
    text: list[str] = []
    cached = 0
    for chunk in client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=new,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - start
            text.append(chunk.choices[0].delta.content)
        usage = chunk.usage
        if usage is not None and usage.prompt_tokens_details is not None:
            cached = int(usage.prompt_tokens_details.cached_tokens or 0)
    return (first if first is not None else time.perf_counter() - start), "".join(text), cached


def chat(server: Server, model: str, system: str, questions: list[str], new: int) -> list[tuple[float, str, int]]:
    client = server.client()
    messages = [{"role": "system", "content": system}]
    turns = []
    for question in questions:
        messages.append({"role": "user", "content": question})
        turn = streamed_turn(client, model, messages, new)
        messages.append({"role": "assistant", "content": turn[1]})
        turns.append(turn)
    return turns


def throughput(server: Server, model: str, system: str, chats: int, turns: int, new: int) -> float:
    """Requests per second with `chats` conversations at once, each `turns` turns."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            questions = [f"(chat {i}) {QUESTIONS[i % len(QUESTIONS)]}", *FOLLOW_UPS][:turns]
            chat(server, model, system, questions, new)
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    start = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(chats)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return chats * turns / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--turns", type=int, default=6, help="turns of the timed chat (default 6)")
    p.add_argument("--system-tokens", type=int, default=1500, help="system prompt length in tokens (default 1500)")
    p.add_argument("--new-tokens", type=int, default=16, help="answer tokens per turn (default 16)")
    p.add_argument("--chats", type=int, default=4, help="concurrent chats for requests/s (default 4)")
    p.add_argument("--chat-turns", type=int, default=3, help="turns per concurrent chat (default 3)")
    p.add_argument("--threads", type=int, default=1, help="threads per server process (default 1)")
    p.add_argument("--servers", default="shipped,cb,ours", help="which servers (default shipped,cb,ours)")
    p.add_argument("--plot", metavar="PATH", help="write the plot as a PNG (e.g. docs/images/bench_serve.png)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--quick", action="store_true", help="3 turns, a 300-token system prompt, 2 chats of 2 turns")
    p.add_argument("--from-json", metavar="PATH", help="print and plot the results a --json run wrote (no servers)")
    args = p.parse_args()
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        plot, json_path = args.plot, None
        args = argparse.Namespace(**{**saved["args"], "plot": plot, "json": json_path})
        _report(saved["results"], args, [""] * args.turns)
        return
    if args.quick:
        args.turns, args.system_tokens, args.new_tokens, args.chats, args.chat_turns = 3, 300, 6, 2, 2
    started = start_run(1)
    print_environment(f", {args.threads} thread(s) per server")
    from transformers import AutoTokenizer

    model = str(smollm2_folder())
    system = system_prompt(args.system_tokens, AutoTokenizer.from_pretrained(model))
    questions = [QUESTIONS[0], *FOLLOW_UPS, *QUESTIONS[1:]][: args.turns]
    names = [n for n in args.servers.split(",") if n in SERVERS]
    servers = {name: Server(name, model, args.threads) for name in names}  # all start at once
    results: dict[str, Any] = {}
    try:
        for server in servers.values():
            server.wait()
        for name, server in servers.items():
            if server.error is not None:
                print(f"{name}: {server.error}")
                continue
            try:
                model_id = server.client().models.list().data[0].id if name == "ours" else model
                streamed_turn(server.client(), model_id, [{"role": "user", "content": "Hello!"}], 2)  # warm-up
                turns = chat(server, model_id, system, questions, args.new_tokens)
                rps = throughput(server, model_id, system, args.chats, args.chat_turns, args.new_tokens)
                results[name] = {"ttft": [t for t, _, _ in turns], "answers": [a for _, a, _ in turns], "rps": rps}
                results[name]["cached"] = [c for _, _, c in turns]
            except Exception as exc:
                server.error = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
                print(f"{name}: {server.error}")
            finally:
                server.stop()  # frees its cores and memory for the next one
    finally:
        for server in servers.values():
            server.stop()
    _report(results, args, questions)
    print_end(started, newline=True)


def _report(results: dict[str, Any], args: argparse.Namespace, questions: list[str]) -> None:
    names = list(results)
    base = results.get("shipped")
    same = {n: base is not None and results[n]["answers"] == base["answers"] for n in names}
    ratio_names = [f"{n}/ours" for n in names if n != "ours"] if "ours" in results else []
    header = ["turn", *[f"{n}_s" for n in names], *ratio_names, "cached"]
    print(f"\ntime to first token per turn (system prompt {args.system_tokens} tokens, {args.new_tokens} new tokens)")
    print("  ".join(f"{h:>12s}" for h in header))
    for i in range(len(questions)):
        cells = [f"{i + 1:>12d}", *[f"{results[n]['ttft'][i]:>12.3f}" for n in names]]
        for n in names:
            if n != "ours" and "ours" in results:
                cells.append(f"{results[n]['ttft'][i] / results['ours']['ttft'][i]:>11.2f}x")
        cells.append(f"{results['ours']['cached'][i] if 'ours' in results else 0:>12d}")
        print("  ".join(cells))
    print(f"\nrequests per second, {args.chats} concurrent chats of {args.chat_turns} turns")
    inverse = [f"ours/{n}" for n in names if n != "ours"] if "ours" in results else []
    print("  ".join(f"{h:>12s}" for h in ["", *names, *inverse]))
    cells = [f"{'req/s':>12s}", *[f"{results[n]['rps']:>12.3f}" for n in names]]
    if "ours" in results:
        cells += [f"{results['ours']['rps'] / results[n]['rps']:>11.2f}x" for n in names if n != "ours"]
    print("  ".join(cells))
    print("same answers as transformers serve: " + ", ".join(f"{n} {'yes' if same[n] else 'NO'}" for n in names))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "use_hub_kernels": os.environ["USE_HUB_KERNELS"],
                    "results": results,
                    "same": same,
                },
                indent=2,
            )
            + "\n"
        )
    if args.plot and results:
        _plot(results, args)


def _plot(results: dict[str, Any], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {
        "shipped": "transformers serve",
        "cb": "transformers serve --continuous-batching",
        "ours": "hf-prefix-cache serve",
    }
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 1]})
    for name, result in results.items():
        turns = range(1, len(result["ttft"]) + 1)
        left.plot(turns, result["ttft"], marker="o", label=labels.get(name, name))
    left.set_xlabel("turn")
    left.set_ylabel("time to first token (s), openai client")
    left.set_title(f"SmolLM2-135M, {args.system_tokens}-token system prompt, CPU, {args.threads} thread(s)")
    left.legend()
    left.grid(alpha=0.3)
    short = {"shipped": "shipped", "cb": "continuous\nbatching", "ours": "hf-prefix-cache"}
    right.bar([short.get(n, n) for n in results], [r["rps"] for r in results.values()], color=["C0", "C1", "C2"])
    right.set_title(f"requests/s, {args.chats} chats at once")
    right.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=110)
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
