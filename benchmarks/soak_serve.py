"""Load without loss: a soak of ``hf-prefix-cache serve --batch`` under many clients (issue #46, point 6).

One server of the real SmolLM2-135M-Instruct with batching on and a small device budget
(``--max-bytes``, default 96MB: SmolLM2 keeps about 46 KB a token in float32, so the store holds about
2,000 tokens, while the 4 shared system prompts of about ``--system-tokens`` (500) tokens and 16
conversations need several times that: it must evict). ``--clients`` (16) client
threads chat for ``--minutes`` (10; ``--quick``: 1): each conversation starts from one of the
system prompts and goes on for up to ``--turns`` (4) turns of ``--new-tokens`` (32) tokens at
temperature 0. A share ``--cancel-rate`` of requests is cancelled: the client closes the stream
after a few answer chunks; a share ``--plain-rate`` is not streamed; the rest stream to the end.
Every ``--sample-s`` (10) seconds the RSS of each of the server's processes is sampled (the
largest is the model's process, where the store is).

At the end, after the clients stop: responses by status (5xx must be 0; 429s are counted, not
failures), client-side errors, ``/v1/cache/stats?check=true``'s pinned nodes (must be 0 once the
last request has ended) and integrity check (must be ``ok``), the store's evictions (must be
above 0), and the model process's RSS in the minute after warm-up (``--warmup``, the first 30% of
the run; a quarter of a run under 4 minutes) against the last minute: flat when the last is at most
5% + 32 MB above it. ``--from-json`` judges a saved run again (another ``--warmup``).
One verdict line: ``soak: PASS`` or ``soak: FAIL (reasons)``; ``--json`` keeps it all.

Run (from the repository root)::

    PYTHONPATH=. python benchmarks/soak_serve.py --quick
    PYTHONPATH=. python benchmarks/soak_serve.py --json benchmarks/results/soak_serve.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from _common import load_average, print_end, print_environment, start_run

from hf_prefix_cache.api.sample_text import FOLLOW_UPS, HANDBOOK, QUESTIONS
from hf_prefix_cache.testing.serve_process import ServeProcess


class Soak:
    """The clients, their counters and the memory samples of one server."""

    def __init__(self, server: ServeProcess, model_id: str, systems: list[str], args: argparse.Namespace) -> None:
        self.server, self.model_id, self.systems, self.args = server, model_id, systems, args
        self.deadline = time.monotonic() + args.minutes * 60
        self.lock = threading.Lock()
        self.status: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self.errors: list[str] = []
        self.server_errors: list[str] = []
        self.samples: list[dict[str, Any]] = []
        self.started = time.monotonic()

    def client(self, index: int) -> None:
        """Conversations until the deadline; every response counted by status."""
        rng = random.Random(index)
        with httpx.Client(base_url=f"{self.server.url}/v1", timeout=600) as http:
            conversation = 0
            while time.monotonic() < self.deadline:
                conversation += 1
                messages = [{"role": "system", "content": rng.choice(self.systems)}]
                for turn in range(rng.randint(1, self.args.turns)):
                    if time.monotonic() >= self.deadline:
                        break
                    question = QUESTIONS[rng.randrange(len(QUESTIONS))] if turn == 0 else rng.choice(FOLLOW_UPS)
                    messages.append({"role": "user", "content": f"(client {index}.{conversation}) {question}"})
                    answer = self.request(http, messages, rng)
                    if answer is None:  # cancelled or failed: the conversation ends here
                        break
                    messages.append({"role": "assistant", "content": answer})

    def request(self, http: httpx.Client, messages: list[dict[str, str]], rng: random.Random) -> str | None:
        """One request, streamed to the end, cancelled after a few chunks, or not streamed; its answer."""
        roll = rng.random()
        kind = (
            "cancel"
            if roll < self.args.cancel_rate
            else "plain"
            if roll < self.args.cancel_rate + self.args.plain_rate
            else "stream"
        )
        body = {"model": self.model_id, "messages": messages, "max_tokens": self.args.new_tokens, "temperature": 0}
        try:
            if kind == "plain":
                response = http.post("/chat/completions", json=body)
                self.count(kind, response.status_code, response.text)
                return str(response.json()["choices"][0]["message"]["content"]) if response.status_code == 200 else None
            cut = rng.randint(1, 8) if kind == "cancel" else None
            with http.stream("POST", "/chat/completions", json={**body, "stream": True}) as response:
                if response.status_code != 200:
                    self.count(kind, response.status_code, response.read().decode(errors="replace"))
                    return None
                text, chunks = [], 0
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.count(kind, 500, json.dumps(chunk)[:300])  # an error event inside a 200 stream
                        return None
                    for choice in chunk.get("choices", []):
                        piece = choice.get("delta", {}).get("content")
                        if piece:
                            text.append(piece)
                            chunks += 1
                    if cut is not None and chunks >= cut:
                        break  # leaving the block closes the stream: the server sees the client go
                self.count(kind, 200, "")
                return None if cut is not None else "".join(text)
        except Exception as exc:
            with self.lock:
                self.errors.append(f"{kind}: {type(exc).__name__}: {str(exc)[:200]}")
            return None

    def count(self, kind: str, status: int, text: str) -> None:
        with self.lock:
            self.status[str(status)] += 1
            self.kinds[kind] += 1
            if status >= 500:
                self.server_errors.append(f"{status} {kind}: {text[:300]}")

    def sample(self) -> None:
        """Every `--sample-s` seconds until the deadline: RSS of the server's processes, pinned nodes."""
        import psutil

        root = psutil.Process(self.server.proc.pid)
        while True:
            rss = {}
            for proc in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    rss[proc.pid] = proc.memory_info().rss
            try:
                store = self.server.store()
                extra = {"pinned": store["pinned_nodes"], "evictions": store["stats"].get("evictions")}
            except Exception as exc:
                extra = {"stats_error": f"{type(exc).__name__}: {exc}"}
            with self.lock:
                done = sum(self.status.values())
            self.samples.append(
                {"t": time.monotonic() - self.started, "rss": rss, "requests": done, "load": load_average(), **extra}
            )
            if time.monotonic() >= self.deadline:
                return
            time.sleep(min(self.args.sample_s, max(0.0, self.deadline - time.monotonic())))


def memory(samples: list[dict[str, Any]], seconds: float, warmup: float) -> dict[str, Any]:
    """The model process's RSS (MB): the first window, the window right after warm-up (the first `warmup` share of
    the run) and the last window (a minute each, a quarter of a shorter run), and whether it stayed flat."""
    model_pid = max(samples[-1]["rss"], key=lambda pid: samples[-1]["rss"][pid])
    points = [(s["t"], s["rss"].get(str(model_pid), s["rss"].get(model_pid, 0)) / 2**20) for s in samples]
    window = min(60.0, seconds / 4)
    warm = max(window, warmup * seconds)
    first = [mb for t, mb in points if t <= window] or [points[0][1]]
    after = [mb for t, mb in points if warm < t <= warm + window] or first
    last = [mb for t, mb in points if t >= seconds - window] or [points[-1][1]]
    after_mean, last_mean = sum(after) / len(after), sum(last) / len(last)
    return {
        "model_pid": model_pid,
        "window_s": window,
        "warmup_s": warm,
        "first_window_mb": sum(first) / len(first),
        "after_warmup_mb": after_mean,
        "last_window_mb": last_mean,
        "peak_mb": max(mb for _, mb in points),
        "flat": last_mean <= after_mean * 1.05 + 32,
        "series_mb": [round(mb, 1) for _, mb in points],
    }


def judge(out: dict[str, Any], warmup: float) -> list[str]:
    """Print what a soak's results (`out`, as ``--json`` keeps them) show; the reasons it fails, if any."""
    status, store, errors = out["status"], out["store"], out["client_errors"]
    mem = out["memory"] = memory(out["samples"], out["args"]["minutes"] * 60, warmup)
    fivexx = sum(n for code, n in status.items() if code.startswith("5"))
    evictions = int(store.get("stats", {}).get("evictions", 0))
    failures = []
    if fivexx:
        failures.append(f"{fivexx} 5xx")
    if store.get("pinned_nodes") != 0:
        failures.append(f"{store.get('pinned_nodes')} pinned nodes")
    if store.get("integrity") != "ok":
        failures.append(f"integrity: {store.get('integrity')}")
    if evictions <= 0:
        failures.append("no eviction")
    if not mem["flat"]:
        failures.append(f"RSS grew {mem['after_warmup_mb']:.0f} -> {mem['last_window_mb']:.0f} MB")
    if errors:
        failures.append(f"{len(errors)} client errors")
    print(f"\nresponses by status: {status}; by kind: {out['kinds']}; client errors: {len(errors)}")
    for line in (out["server_errors"] + errors)[:5]:
        print(f"  {line}")
    print(
        f"store: pinned nodes {store.get('pinned_nodes')}, integrity {store.get('integrity')}, evictions {evictions}, "
        f"requests {store.get('stats', {}).get('requests')}, hit tokens {store.get('stats', {}).get('hit_tokens')}"
    )
    print(
        f"model process RSS (MB, windows of {mem['window_s']:.0f} s): first {mem['first_window_mb']:.0f}, "
        f"after warm-up ({mem['warmup_s']:.0f} s) {mem['after_warmup_mb']:.0f}, last {mem['last_window_mb']:.0f}, "
        f"peak {mem['peak_mb']:.0f}"
    )
    batching = store.get("batching") or {}
    print(
        f"batching: {batching.get('steps')} steps, {batching.get('row_steps')} row steps, "
        f"{batching.get('pieces')} prompt pieces (--prefill-chunk {out['args'].get('prefill_chunk')})"
    )
    loads = [s["load"] for s in out["samples"]]
    print(f"load average during the soak: {loads[0]} -> {loads[-1]}")
    print(f"soak: {'PASS' if not failures else 'FAIL (' + '; '.join(failures) + ')'}")
    out["failures"] = failures
    return failures


def system_prompts(tokens: int, tokenizer: Any) -> list[str]:
    """4 system prompts of about `tokens` tokens, different from their first token on."""
    text = HANDBOOK
    while len(tokenizer(text).input_ids) < tokens:
        text += "\n" + HANDBOOK
    body = str(tokenizer.decode(tokenizer(text).input_ids[:tokens]))
    return [f"Deployment {name}. {body}" for name in ("north", "south", "east", "west")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--minutes", type=float, default=10, help="how long the clients run (default 10)")
    p.add_argument("--clients", type=int, default=16, help="client threads (default 16)")
    p.add_argument("--max-bytes", default="96MB", help="the store's device budget (default 96MB)")
    p.add_argument("--system-tokens", type=int, default=500, help="tokens of each system prompt (default 500)")
    p.add_argument("--turns", type=int, default=4, help="most turns of a conversation (default 4)")
    p.add_argument("--new-tokens", type=int, default=32, help="answer tokens (default 32)")
    p.add_argument("--cancel-rate", type=float, default=0.15, help="share of requests cancelled (default 0.15)")
    p.add_argument("--plain-rate", type=float, default=0.15, help="share not streamed (default 0.15)")
    p.add_argument("--sample-s", type=float, default=10, help="seconds between memory samples (default 10)")
    p.add_argument("--threads", type=int, default=2, help="the server's threads (default 2)")
    p.add_argument("--prefill-chunk", type=int, help="the server's --prefill-chunk (default: the server's, 512)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--warmup", type=float, default=0.3, help="share of the run that is warm-up (default 0.3)")
    p.add_argument("--quick", action="store_true", help="1 minute")
    p.add_argument("--from-json", metavar="PATH", help="judge a --json run's results again (no server)")
    args = p.parse_args()
    if args.from_json:
        judge(json.loads(Path(args.from_json).read_text()), args.warmup)
        return
    if args.quick:
        args.minutes = 1.0
    started = start_run(1)
    print_environment(f", server threads {args.threads}, {args.clients} clients, {args.minutes:g} min")
    from transformers import AutoTokenizer

    from hf_prefix_cache.api.models import smollm2_folder

    model = str(smollm2_folder())
    systems = system_prompts(args.system_tokens, AutoTokenizer.from_pretrained(model))
    env = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads), "HF_PREFIX_CACHE_BATCH": "1"}
    chunk = () if args.prefill_chunk is None else ("--prefill-chunk", str(args.prefill_chunk))
    server = ServeProcess(model, "--batch", "--max-bytes", args.max_bytes, *chunk, env=env, name="soak-serve")
    try:
        server.wait(600)
        model_id = server.client().models.list().data[0].id
        soak = Soak(server, model_id, systems, args)
        threads = [threading.Thread(target=soak.client, args=(i,), daemon=True) for i in range(args.clients)]
        sampler = threading.Thread(target=soak.sample, daemon=True)
        for thread in [sampler, *threads]:
            thread.start()
        for thread in threads:
            thread.join()
        sampler.join()
        ended = time.monotonic()
        final: dict[str, Any] = {}
        while time.monotonic() - ended < 60:  # pins go when the last rows have ended
            final = server.store(check=True)
            if final["pinned_nodes"] == 0:
                break
            time.sleep(1)
        tail = server.tail(2000)
    finally:
        server.stop()
    out = {
        "args": {k: v for k, v in vars(args).items() if k not in ("json", "from_json")},
        "status": dict(soak.status),
        "kinds": dict(soak.kinds),
        "server_errors": soak.server_errors[:50],
        "client_errors": soak.errors[:50],
        "store": final,
        "samples": soak.samples,
        "server_log_tail": tail,
    }
    judge(out, args.warmup)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")
    print_end(started, newline=True)


if __name__ == "__main__":
    main()
