"""Many users side by side: 1 to 32 concurrent multi-turn chats on four servers (issue #46, point 5).

Servers, each on a free loopback port, each process limited to ``--threads`` threads:

* ``ours-batch``: ``hf-prefix-cache serve --batch`` (the requests in flight decoded together);
* ``ours-seq``: ``hf-prefix-cache serve --no-batch`` (one request at a time, the store on);
* ``ours-unpacked`` (only when named in ``--servers``): ``--batch --no-pack-joins``, every arrival prefilled by
  a forward of its own before it joins (the engine before rows joined in the step's own forward);
* ``shipped``: ``transformers serve`` as shipped;
* ``cb``: ``transformers serve --continuous-batching`` (it cannot load hybrids: reported, not fatal).

At each level of ``--chats`` (default 1,4,8,32) every server in turn runs that many chats at once,
one client thread each (the others idle). A chat is ``--turns`` (3) streamed turns at temperature 0,
``--new-tokens`` (48) each, after a shared system prompt of about ``--system-tokens`` (1,500) tokens;
its questions are its own. Every server first answers one warm-up request with that system prompt
(as a deployed server has seen its system prompt before). With ``--model vlm`` the first turn of every
chat also sends an image of its own.

Per server and level: aggregate output tokens per second (every answer's tokens over the level's
wall time), time to first token p50/p95 over all turns and from turn 2 (sent to the first chunk with
answer text), time per output token p50/p95 (first to last answer chunk over the tokens after the
first, per request), and how many answers equal ``ours-seq``'s (same chat, same turn). The table's
ratios are measured side by side in one run: ``batch/seq`` and ``batch/cb`` for tokens per second,
``cb/batch`` for time to first token from turn 2. The issue's CPU targets, at 8 chats: tok/s of
``ours-batch`` at least 3x ``ours-seq``'s and at least ``cb``'s; its TTFT p95 from turn 2 at most a
quarter of ``cb``'s. They are printed as met or not, never asserted.

Models (``--model``): ``smollm2`` (the real SmolLM2-135M-Instruct), ``hybrid`` (a random-weight
3-layer Bamba, mamba2 + attention, with SmolLM2's tokenizer) and ``vlm`` (the front ends' tiny
random-weight LLaVA with its real processor), the tiny ones saved to a temporary folder first.

Run (from the repository root)::

    PYTHONPATH=. python benchmarks/bench_serve_load.py --quick          # 1,4 chats, short prompts, a few minutes
    PYTHONPATH=. python benchmarks/bench_serve_load.py --chats 1,4,8 \\
        --json benchmarks/results/bench_serve_load.json --plot benchmarks/results/bench_serve_load.png
    PYTHONPATH=. python benchmarks/bench_serve_load.py --model hybrid --chats 1,4,8
    PYTHONPATH=. python benchmarks/bench_serve_load.py --from-json benchmarks/results/bench_serve_load.json

``--device cuda`` passes ``--device`` to our server (transformers serve picks the GPU itself).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import load_average, print_end, print_environment, start_run, system_prompt

from hf_prefix_cache.api.sample_text import FOLLOW_UPS, QUESTIONS
from hf_prefix_cache.testing.serve_process import ServeProcess, image_url

#: The servers in the order they run at each level.
NAMES = ("ours-batch", "ours-unpacked", "ours-seq", "shipped", "cb")
#: The servers run when ``--servers`` is not given.
DEFAULT = ("ours-batch", "ours-seq", "shipped", "cb")
LABELS = {
    "ours-batch": "hf-prefix-cache serve --batch",
    "ours-unpacked": "hf-prefix-cache serve --batch --no-pack-joins",
    "ours-seq": "hf-prefix-cache serve --no-batch",
    "shipped": "transformers serve",
    "cb": "transformers serve --continuous-batching",
}


#: The share of free memory transformers' continuous batching may take for its KV blocks: its default (0.6 to 0.9)
#: took 14 GB of a shared 24 GB CPU machine; 0.1 holds 32 chats of SmolLM2 many times over.
CB_MEMORY = 0.1


def batch_flags() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The arguments of batching on and off: ``--batch`` / ``--no-batch``, or nothing for off where this
    checkout's parser has no ``--no-batch`` yet (the spike, where off is the default)."""
    from hf_prefix_cache.frontends.serve_args import build_parser

    options = {s for action in build_parser()._actions for s in action.option_strings}
    return ("--batch",), (("--no-batch",) if "--no-batch" in options else ())


def server_args(name: str, device: str) -> tuple[bool, tuple[str, ...]]:
    """Whether `name` is ours, and the arguments after the model."""
    on, off = batch_flags()
    ours_device = () if device == "auto" else ("--device", device)
    return {
        "ours-batch": (True, (*on, *ours_device)),
        "ours-unpacked": (True, (*on, "--no-pack-joins", *ours_device)),
        "ours-seq": (True, (*off, *ours_device)),
        "shipped": (False, ()),
        "cb": (False, ("--continuous-batching", "--cb-max-memory-percent", str(CB_MEMORY))),
    }[name]


class Server:
    """One server process; `error` says why it is unusable, if it is."""

    def __init__(self, name: str, model: str, threads: int, device: str) -> None:
        ours, args = server_args(name, device)
        self.name, self.ours = name, ours
        self.error: str | None = None
        self.model_id = model
        env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        if name in ("ours-batch", "ours-unpacked"):
            env["HF_PREFIX_CACHE_BATCH"] = "1"  # also what --batch sets; harmless where the default is on
        elif name == "ours-seq":
            env["HF_PREFIX_CACHE_BATCH"] = "0"
        self.process = ServeProcess(model, *args, ours=ours, env=env, name=f"bench-load-{name}")

    def wait(self, timeout: float) -> None:
        try:
            self.process.wait(timeout)
            if self.ours:
                self.model_id = self.process.client().models.list().data[0].id
        except Exception as exc:
            self.error = f"fails to load ({_one_line(str(exc), self.process.tail(400))})"

    def stop(self) -> None:
        self.process.stop()


def _one_line(*texts: str) -> str:
    return " | ".join(t.strip().replace("\n", " | ")[-300:] for t in texts if t.strip())


def streamed_turn(server: Server, messages: list[dict[str, Any]], new: int) -> tuple[dict[str, Any], str]:
    """One streamed request: seconds to the first and last answer chunk, the answer, its token count."""
    client = server.process.client(timeout=900)
    start = time.perf_counter()
    first = last = None
    text: list[str] = []
    chunks = 0
    completion: int | None = None
    for chunk in client.chat.completions.create(
        model=server.model_id,
        messages=messages,
        max_tokens=new,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter() - start
            first = last if first is None else first
            text.append(chunk.choices[0].delta.content)
            chunks += 1
        if chunk.usage is not None and chunk.usage.completion_tokens:
            completion = int(chunk.usage.completion_tokens)
    end = time.perf_counter() - start
    tokens = completion if completion is not None else chunks
    timing = {"ttft": first if first is not None else end, "last": last or end, "end": end, "tokens": tokens}
    return timing, "".join(text)


def chat_questions(level: int, i: int, turns: int) -> list[str]:
    """Chat `i`'s own questions (distinct across levels, so no level reuses another's conversation)."""
    head = f"(user {level}-{i}) {QUESTIONS[i % len(QUESTIONS)]}"
    tail = [FOLLOW_UPS[(i + k) % len(FOLLOW_UPS)] for k in range(turns - 1)]
    return [head, *tail]


def run_level(server: Server, system: str, level: int, args: argparse.Namespace) -> dict[str, Any]:
    """`level` chats at once on `server`: every request's timings and answers, and the wall time."""
    requests: list[dict[str, Any]] = []
    errors: list[str] = []
    lock = threading.Lock()

    def one_chat(i: int) -> None:
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        for turn, question in enumerate(chat_questions(level, i, args.turns), start=1):
            content: Any = question
            if args.model == "vlm" and turn == 1:
                content = [{"type": "image_url", "image_url": {"url": image_url(1000 * level + i)}}]
                content.append({"type": "text", "text": question})
            messages.append({"role": "user", "content": content})
            try:
                timing, answer = streamed_turn(server, messages, args.new_tokens)
            except Exception as exc:
                with lock:
                    errors.append(f"chat {i} turn {turn}: {type(exc).__name__}: {str(exc)[:200]}")
                return
            messages.append({"role": "assistant", "content": answer})
            with lock:
                requests.append({"chat": i, "turn": turn, **timing, "answer": answer})

    start = time.perf_counter()
    threads = [threading.Thread(target=one_chat, args=(i,)) for i in range(level)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    requests.sort(key=lambda r: (r["chat"], r["turn"]))
    return {"wall": wall, "requests": requests, "errors": errors, "load": load_average()}


def percentile(values: list[float], q: float) -> float | None:
    """The `q` quantile (0-1) by linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def metrics(run: dict[str, Any], reference: dict[str, Any] | None) -> dict[str, Any]:
    """Aggregate tokens/s, TTFT and TPOT percentiles, and the answers equal to `reference`'s."""
    reqs = run["requests"]
    ttft = [r["ttft"] for r in reqs]
    later = [r["ttft"] for r in reqs if r["turn"] >= 2]
    tpot = [(r["last"] - r["ttft"]) / (r["tokens"] - 1) for r in reqs if r["tokens"] > 1]
    out: dict[str, Any] = {
        "requests": len(reqs),
        "errors": len(run["errors"]),
        "tokens": sum(r["tokens"] for r in reqs),
        "tok_s": sum(r["tokens"] for r in reqs) / run["wall"],
        "ttft_p50": percentile(ttft, 0.5),
        "ttft_p95": percentile(ttft, 0.95),
        "ttft2_p50": percentile(later, 0.5),
        "ttft2_p95": percentile(later, 0.95),
        "tpot_p50": percentile(tpot, 0.5),
        "tpot_p95": percentile(tpot, 0.95),
    }
    if reference is not None:
        answers = {(r["chat"], r["turn"]): r["answer"] for r in reference["requests"]}
        out["same"] = sum(answers.get((r["chat"], r["turn"])) == r["answer"] for r in reqs)
    return out


def build_model(kind: str, folder: Path) -> str:
    """The model folder or name each server loads for `kind`."""
    from hf_prefix_cache.api.models import smollm2_folder

    if kind == "smollm2":
        return str(smollm2_folder())
    if kind == "vlm":
        from hf_prefix_cache.testing.serve_process import tiny_vlm_folder

        return str(tiny_vlm_folder(folder))
    from hf_prefix_cache.testing.serve_process import tiny_hybrid_folder

    return tiny_hybrid_folder(folder)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--model", choices=("smollm2", "hybrid", "vlm"), default="smollm2")
    p.add_argument("--chats", default="1,4,8,32", help="concurrency levels (default 1,4,8,32)")
    p.add_argument("--turns", type=int, default=3, help="turns per chat (default 3)")
    p.add_argument("--system-tokens", type=int, default=1500, help="shared system prompt in tokens (default 1500)")
    p.add_argument("--new-tokens", type=int, default=48, help="answer tokens per turn (default 48)")
    p.add_argument("--threads", type=int, default=1, help="threads per server process (default 1)")
    p.add_argument(
        "--servers", default=",".join(DEFAULT), help=f"which of {','.join(NAMES)} (default {','.join(DEFAULT)})"
    )
    p.add_argument("--device", default="auto", help="our servers' --device (default auto)")
    p.add_argument("--plot", metavar="PATH", help="write the plot as a PNG")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--quick", action="store_true", help="chats 1,4, 2 turns, a 300-token prompt, 16 new tokens")
    p.add_argument("--from-json", metavar="PATH", help="print and plot a --json run's results (no servers)")
    args = p.parse_args()
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        report(saved, args.plot)
        return
    if args.quick:
        args.chats, args.turns, args.system_tokens, args.new_tokens = "1,4", 2, 300, 16
    levels = [int(c) for c in args.chats.split(",")]
    started = start_run(1)
    print_environment(f", {args.threads} thread(s) per server, model {args.model}")
    from transformers import AutoTokenizer

    folder = Path(tempfile.mkdtemp(prefix=f"bench-load-{args.model}-"))
    model = build_model(args.model, folder)
    system = system_prompt(args.system_tokens, AutoTokenizer.from_pretrained(model))
    names = [n for n in args.servers.split(",") if n in NAMES]
    servers = {name: Server(name, model, args.threads, args.device) for name in names}  # all start at once
    runs: dict[str, dict[str, Any]] = {name: {} for name in names}
    load_start = load_average()
    try:
        for server in servers.values():
            server.wait(600)
            if server.error is None:
                try:  # warm-up: the shared system prompt, seen once before the chats
                    warm = [{"role": "system", "content": system}, {"role": "user", "content": "Hello!"}]
                    streamed_turn(server, warm, 2)
                except Exception as exc:
                    server.error = f"failed warm-up: {type(exc).__name__}: {str(exc)[:200]}"
            if server.error is not None:
                print(f"{server.name}: {server.error}")
        for level in levels:
            for name, server in servers.items():
                if server.error is not None:
                    continue
                run = run_level(server, system, level, args)
                runs[name][str(level)] = run
                m = metrics(run, None)
                print(
                    f"{level:>3d} chats  {name:<10s} {m['tok_s']:7.2f} tok/s  TTFT p95 {m['ttft_p95'] or 0:7.2f} s  "
                    f"wall {run['wall']:7.1f} s  errors {len(run['errors'])}  load {run['load']}",
                    flush=True,
                )
                for error in run["errors"][:3]:
                    print(f"    {error}")
    finally:
        for server in servers.values():
            server.stop()
    saved = {
        "args": {k: v for k, v in vars(args).items() if k not in ("plot", "json", "from_json")},
        "levels": levels,
        "environment": environment(load_start),
        "failed": {n: s.error for n, s in servers.items() if s.error is not None},
        "runs": runs,
    }
    saved["metrics"] = all_metrics(saved)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(saved, indent=1) + "\n")
        print(f"wrote {args.json}")
    report(saved, args.plot)
    print_end(started, newline=True)


def environment(load_start: str) -> dict[str, Any]:
    import torch
    import transformers

    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "use_hub_kernels": os.environ.get("USE_HUB_KERNELS"),
        "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "gpu": card,
        "load_start": load_start,
        "load_end": load_average(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def all_metrics(saved: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """Metrics per server and level, answers compared with ``ours-seq``'s at the same level."""
    runs = saved["runs"]
    reference = runs.get("ours-seq", {})
    return {
        name: {level: metrics(run, reference.get(level)) for level, run in by_level.items()}
        for name, by_level in runs.items()
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _fmt(value: float | None, spec: str = ".2f", unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def targets(m: dict[str, dict[str, dict[str, Any]]], level: str = "8") -> list[tuple[str, float | None, bool | None]]:
    """The issue's CPU targets at `level` chats: what each is, the measured ratio, and whether it is met."""
    batch, seq, cb = (m.get(n, {}).get(level) for n in ("ours-batch", "ours-seq", "cb"))
    rows: list[tuple[str, float | None, bool | None]] = []
    if batch is None:
        return rows
    vs_seq = _ratio(batch["tok_s"], seq["tok_s"]) if seq else None
    vs_cb = _ratio(batch["tok_s"], cb["tok_s"]) if cb else None
    ttft = _ratio(batch["ttft2_p95"], cb["ttft2_p95"]) if cb else None
    rows.append(("tok/s batch/seq >= 3", vs_seq, None if vs_seq is None else vs_seq >= 3))
    rows.append(("tok/s batch/cb >= 1", vs_cb, None if vs_cb is None else vs_cb >= 1))
    rows.append(("TTFT p95 from turn 2, batch/cb <= 0.25", ttft, None if ttft is None else ttft <= 0.25))
    return rows


def report(saved: dict[str, Any], plot: str | None) -> None:
    """The table, the ratios and the targets; the plot where asked."""
    m: dict[str, dict[str, dict[str, Any]]] = saved["metrics"]
    args = saved["args"]
    env = saved["environment"]
    print(
        f"\n{args['model']}: {args['turns']} turns a chat, system prompt {args['system_tokens']} tokens, "
        f"{args['new_tokens']} new tokens, {args['threads']} thread(s) a server; "
        f"load average {env['load_start']} -> {env['load_end']}, {env['cpus']} CPUs, GPU {env['gpu'] or 'none'}"
    )
    for name, error in saved["failed"].items():
        print(f"{name}: {error}")
    head = ["chats", "server", "tok/s", "TTFT p50", "p95", "turn>=2 p50", "p95", "TPOT p50", "p95", "same", "err"]
    print("  ".join(f"{h:>11s}" for h in head))
    for level in [str(x) for x in saved["levels"]]:
        for name in m:
            r = m[name].get(level)
            if r is None:
                continue
            cells = [level, name, _fmt(r["tok_s"])]
            cells += [_fmt(r[k], ".3f") for k in ("ttft_p50", "ttft_p95", "ttft2_p50", "ttft2_p95")]
            cells += [_fmt(r[k] * 1000 if r[k] is not None else None, ".1f", " ms") for k in ("tpot_p50", "tpot_p95")]
            cells += [f"{r.get('same', '-')}/{r['requests']}", str(r["errors"])]
            print("  ".join(f"{c:>11s}" for c in cells))
    print(
        "\nratios, side by side at each level (tok/s: batch/seq, batch/cb, batch/shipped; TTFT p95 turn>=2: cb/batch)"
    )
    for level in [str(x) for x in saved["levels"]]:
        batch = m.get("ours-batch", {}).get(level)
        if batch is None:
            continue
        others = {n: m.get(n, {}).get(level) for n in ("ours-seq", "cb", "shipped")}
        if m.get("ours-unpacked", {}).get(level) is not None:
            others["ours-unpacked"] = m["ours-unpacked"][level]
        cells = [f"{level:>5s} chats"]
        for n, r in others.items():
            cells.append(f"batch/{n} {_fmt(_ratio(batch['tok_s'], r['tok_s']) if r else None, '.2f', 'x')}")
        cb = others["cb"]
        cells.append(f"TTFT2 cb/batch {_fmt(_ratio(cb['ttft2_p95'], batch['ttft2_p95']) if cb else None, '.2f', 'x')}")
        print("  ".join(cells))
    rows = targets(m)
    if rows:
        print("\ntargets at 8 chats (CPU):")
        for what, value, met in rows:
            verdict = "n/a" if met is None else ("met" if met else "NOT met")
            print(f"  {what:<40s} {_fmt(value, '.2f')}  {verdict}")
    if plot:
        _plot(saved, plot)


def _plot(saved: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = saved["metrics"]
    args = saved["args"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [
        ("tok_s", "aggregate output tokens/s"),
        ("ttft2_p95", "TTFT p95 from turn 2 (s)"),
        ("tpot_p50", "TPOT p50 (s)"),
    ]
    for ax, (key, title) in zip(axes, panels, strict=True):
        for name, by_level in m.items():
            points = [(int(lv), r[key]) for lv, r in by_level.items() if r[key] is not None]
            if points:
                xs, ys = zip(*sorted(points), strict=True)
                ax.plot(xs, ys, marker="o", label=LABELS.get(name, name))
        ax.set_xscale("log", base=2)
        ax.set_xticks(saved["levels"], [str(x) for x in saved["levels"]])
        ax.set_xlabel("concurrent chats")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if key != "tok_s":
            ax.set_yscale("log")
    axes[0].legend(fontsize=8)
    env = saved["environment"]
    where = env["gpu"] or f"CPU ({env['cpus']} cores, load {env['load_start']} -> {env['load_end']})"
    fig.suptitle(
        f"{args['model']}: {args['turns']}-turn chats, {args['system_tokens']}-token shared system prompt, "
        f"{args['new_tokens']} new tokens, {where}",
        fontsize=10,
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
