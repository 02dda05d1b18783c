"""A long cold prompt arriving while other rows decode: prefilled whole or in pieces (``--prefill-chunk``, issue #46).

On the batching engine's loop (`Scheduler`, in this process, the real SmolLM2-135M-Instruct, or with
``--model hybrid`` a random-weight Bamba of its size, 25 Mamba-2 and 5 attention layers, whose recurrent
states are snapshotted where the pieces stop), ``--rows`` chats decode (a shared system prompt of about
``--system-tokens`` tokens, stored first, then a question each, ``--new-tokens`` tokens an answer, never
stopping early). Once every one of them has its first ``--lead`` tokens, a newcomer arrives: the same
system prompt under a salt of its own (so nothing of it
is stored: ``--system-tokens`` tokens to prefill) and a question.

For each chunk size (``--chunks``; 0: the whole prompt in one forward, as before) it reports:

* the rows in flight: their longest gap between two tokens while the newcomer prefills, and their time per
  output token p95 over the whole run;
* the newcomer: its time to first token;
* the wall time, and whether every answer equals the whole-prefill run's (the pieces' logits agree with
  one forward's to float tolerance, so greedy answers should be the same).

Ratios are against chunk 0 in the same run. Nothing is asserted: a busy machine skews every timing.

Run (from the repository root)::

    PYTHONPATH=. python benchmarks/bench_prefill_chunks.py
    PYTHONPATH=. python benchmarks/bench_prefill_chunks.py --chunks 0,512,256,128 --threads 2
    PYTHONPATH=. python benchmarks/bench_prefill_chunks.py --model hybrid
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from _common import print_end, print_environment, start_run, system_prompt

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.api.models import load_smollm2
from hf_prefix_cache.api.sample_text import FOLLOW_UPS, QUESTIONS
from hf_prefix_cache.batching.rows import Request, Row
from hf_prefix_cache.batching.scheduler import Scheduler

#: The rows' questions (at most 8 rows), then the newcomer's (the last).
QUESTIONS_AND_FOLLOW_UPS = (*QUESTIONS, *FOLLOW_UPS)


def chat_ids(tokenizer: Any, system: str, question: str) -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def one_run(model: Any, tokenizer: Any, system: str, chunk: int, args: argparse.Namespace) -> dict[str, Any]:
    """The rows, then the newcomer after `--lead` tokens, on a fresh store; the timings and the answers."""
    store = PrefixCache(model)
    scheduler = Scheduler(store, prefill_chunk=chunk)
    scheduler.submit(Request(chat_ids(tokenizer, system, "Hello."), max_new_tokens=1))
    scheduler.run_until_idle()  # the system prompt stored; no end ids: answers run to --new-tokens in every run
    stamps: dict[int, list[float]] = {}

    def on_token(row: Row, token: int) -> None:
        stamps.setdefault(id(row), []).append(time.perf_counter())

    rows = [
        scheduler.submit(Request(chat_ids(tokenizer, system, q), max_new_tokens=args.new_tokens), on_token=on_token)
        for q in QUESTIONS_AND_FOLLOW_UPS[: args.rows]
    ]
    start = time.perf_counter()
    while min(len(row.tokens) for row in rows) < args.lead:
        scheduler.cycle()
    newcomer_ids = chat_ids(tokenizer, system, QUESTIONS_AND_FOLLOW_UPS[-1])
    arrived = time.perf_counter()
    newcomer = scheduler.submit(Request(newcomer_ids, max_new_tokens=args.new_tokens, salt="newcomer"))
    while not newcomer.tokens:
        scheduler.cycle()
    first = time.perf_counter()
    scheduler.run_until_idle()
    wall = time.perf_counter() - start
    gaps_during, gaps_all = [], []
    for row in rows:
        times = stamps[id(row)]
        for a, b in zip(times, times[1:], strict=False):
            gaps_all.append(b - a)
            if b >= arrived and a <= first:
                gaps_during.append(b - a)
    store.detach()
    return {
        "chunk": chunk,
        "newcomer_prompt": len(newcomer_ids),
        "newcomer_cached": newcomer.cached_tokens,
        "ttft": first - arrived,
        "max_gap": max(gaps_during) if gaps_during else 0.0,
        "tpot_p95": percentile(gaps_all, 0.95),
        "wall": wall,
        "answers": [row.tokens for row in (*rows, newcomer)],
    }


def load_model(kind: str) -> tuple[Any, Any]:
    """SmolLM2, or a random-weight Bamba of about its size with its tokenizer (answers are noise; timings are not)."""
    model, tokenizer = load_smollm2()
    if kind == "smollm2":
        return model, tokenizer
    import torch
    from transformers import BambaConfig, BambaForCausalLM

    config = BambaConfig(
        vocab_size=len(tokenizer),
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        attn_layer_indices=[5, 11, 17, 23, 29],  # one attention layer in six; the rest Mamba-2
        mamba_n_heads=18,
        mamba_d_head=64,
        mamba_n_groups=1,
        mamba_d_state=64,
        mamba_expand=2,
        mamba_chunk_size=256,
        max_position_embeddings=8192,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return BambaForCausalLM(config).eval(), tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--chunks", default="0,512,256", help="chunk sizes, comma-separated (0: whole; default 0,512,256)"
    )
    parser.add_argument("--rows", type=int, default=7, help="rows decoding when the newcomer arrives (1-8, default 7)")
    parser.add_argument("--system-tokens", type=int, default=1500, help="system prompt tokens (default 1500)")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens an answer (default 48)")
    parser.add_argument("--lead", type=int, default=4, help="tokens every row has when the newcomer arrives")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument(
        "--model",
        choices=("smollm2", "hybrid"),
        default="smollm2",
        help="smollm2 (default) or hybrid: a random-weight Bamba of SmolLM2's size (25 Mamba-2 and 5 attention layers)",
    )
    args = parser.parse_args()
    if not 1 <= args.rows < len(QUESTIONS_AND_FOLLOW_UPS):
        parser.error(f"--rows is 1 to {len(QUESTIONS_AND_FOLLOW_UPS) - 1}")
    started = start_run(args.threads)
    print_environment(f", {args.threads} threads")
    model, tokenizer = load_model(args.model)
    system = system_prompt(args.system_tokens, tokenizer)
    chunks = [int(c) for c in args.chunks.split(",")]
    runs = [one_run(model, tokenizer, system, chunk, args) for chunk in chunks]
    base = runs[0]
    print(
        f"\n{args.rows} rows decoding; a newcomer of {base['newcomer_prompt']} prompt tokens "
        f"({base['newcomer_cached']} stored) arrives after {args.lead} tokens; {args.new_tokens} tokens an answer"
    )
    print(
        f"{'chunk':>6} {'newcomer TTFT s':>16} {'rows max gap s':>15} {'rows TPOT p95 s':>16} {'wall s':>7} "
        f"{'gap vs whole':>13} {'TTFT vs whole':>14} {'same answers':>13}"
    )
    for run in runs:
        same = sum(a == b for a, b in zip(run["answers"], base["answers"], strict=True))
        print(
            f"{run['chunk'] or 'whole':>6} {run['ttft']:16.2f} {run['max_gap']:15.2f} {run['tpot_p95']:16.3f} "
            f"{run['wall']:7.1f} {run['max_gap'] / base['max_gap']:12.2f}x {run['ttft'] / base['ttft']:13.2f}x "
            f"{same:>6}/{len(run['answers'])}"
        )
    print_end(started, newline=True)


if __name__ == "__main__":
    main()
