"""SPIKE (#46): 8 concurrent streamed chat requests sharing a ~1,000-token system prompt, ``serve`` with and
without ``--batch``, in one run: each request's time to first token, total tokens/s, answers compared.

    PYTHONPATH=$PWD python benchmarks/spike_serve_batch.py [--device cpu] [--n 8] [--tokens 48]

Measured 2026-12-07, CPU (2 cores), SmolLM2-135M, 8 requests, 995-token prompt (992 cached after the
first), temperature 0, max 48 tokens (several end at EOS: 192 tokens in all):

    batch OFF: TTFT s [2.52 4.56 6.60 13.55 8.16 9.91 16.31 14.83]  wall 17.98 s  10.7 tok/s
    batch ON:  TTFT s [2.35 2.71 2.52 2.95 3.13 3.36 3.60 3.84]     wall  9.69 s  19.8 tok/s
    answers equal off vs on: 8/8; store stats equal (requests, hits, hit tokens) but for `nodes`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import httpx

TOPICS = ["rivers", "volcanoes", "bridges", "owls", "glaciers", "comets", "tides", "deserts", "forests", "reefs"]


def system_prompt() -> str:
    rules = [
        f"Rule {i}: when the user asks about {TOPICS[i % len(TOPICS)]}, answer plainly, cite no sources, "
        f"keep to facts a school atlas would hold, and never invent numbers (guideline {i * 7 % 13})."
        for i in range(25)
    ]
    return "You are a careful geography tutor.\n" + "\n".join(rules)


async def one(client: httpx.AsyncClient, base: str, i: int, tokens: int, system: str) -> dict:
    body = {
        "model": "smollm2",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"In two sentences, what are {TOPICS[i % len(TOPICS)]}? (question {i})"},
        ],
        "temperature": 0,
        "max_tokens": tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    ttft = None
    text = []
    usage = None
    async with client.stream("POST", f"{base}/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
    return {"i": i, "ttft": ttft, "total": time.perf_counter() - t0, "text": "".join(text), "usage": usage}


async def burst(base: str, n: int, tokens: int) -> tuple[list[dict], float]:
    system = system_prompt()
    async with httpx.AsyncClient(timeout=600) as client:
        await one(client, base, 99, 4, "Warm-up: a different, short system prompt.")
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(client, base, i, tokens, system) for i in range(n)))
        wall = time.perf_counter() - t0
        stats = (await client.get(f"{base}/cache/stats")).json()
    return list(results), wall, stats


def wait_up(base: str, proc: subprocess.Popen, limit: float = 300) -> None:
    t0 = time.time()
    while time.time() - t0 < limit:
        if proc.poll() is not None:
            raise SystemExit(f"server exited {proc.returncode}")
        try:
            if httpx.get(f"{base}/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit("server did not come up")


def run_mode(batch: bool, port: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "hf_prefix_cache", "serve", "--port", str(port), "--device", args.device]
    if batch:
        cmd.append("--batch")
    env = dict(os.environ)
    env.pop("HF_PREFIX_CACHE_BATCH", None)
    log_path = f"{args.log_dir}/serve_{'on' if batch else 'off'}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://localhost:{port}/v1"
    try:
        wait_up(base, proc)
        results, wall, stats = asyncio.run(burst(base, args.n, args.tokens))
    finally:
        proc.terminate()
        proc.wait(60)
    generated = sum((r["usage"] or {}).get("completion_tokens", 0) for r in results)
    return {"batch": batch, "results": results, "wall": wall, "generated": generated, "stats": stats}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--log-dir", default="/tmp")
    parser.add_argument("--json", help="write the raw results here")
    args = parser.parse_args()
    runs = [run_mode(False, 8311, args), run_mode(True, 8312, args)]
    for run in runs:
        mode = "ON " if run["batch"] else "OFF"
        ttfts = " ".join(f"{r['ttft']:.2f}" for r in run["results"])
        print(
            f"batch {mode}: TTFT s per request [{ttfts}]  wall {run['wall']:.2f}s  "
            f"{run['generated']} tokens  {run['generated'] / run['wall']:.1f} tok/s"
        )
        cached = [(r["usage"] or {}).get("prompt_tokens_details") for r in run["results"]]
        print(f"   usage prompt details: {cached[:2]}")
    off, on = (run["results"] for run in runs)
    same = [a["text"] == b["text"] for a, b in zip(off, on, strict=True)]
    print(f"answers equal off vs on: {sum(same)}/{len(same)}")
    for a, b in zip(off, on, strict=True):
        if a["text"] != b["text"]:
            print(f"  differs #{a['i']}:\n    off: {a['text']!r}\n    on:  {b['text']!r}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
