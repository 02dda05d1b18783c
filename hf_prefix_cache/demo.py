"""The quick-start demo: what the store saves on a built-in tiny model, offline.

Builds a small random-weight Llama from its config (no download), then runs three workloads
through `model.generate(..., past_key_values=store)` next to the same calls without the
store: questions after one long system prompt, a multi-turn chat, and an exact repeat. For
each it checks that the tokens are identical and prints time and reused tokens.

Run: ``python -m hf_prefix_cache.demo`` (``--help`` for sizes).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from . import PrefixCache


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


def _timed(model: Any, ids: torch.Tensor, new: int, **kwargs: Any) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, **kwargs)
    return out, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args(argv)

    vocab = 1000
    model = build_tiny_llama(args.layers, args.hidden, vocab)
    store = PrefixCache(model)
    gen = torch.Generator().manual_seed(1)

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(4, vocab, (1, n), generator=gen)

    print(f"tiny Llama: {args.layers} layers, hidden {args.hidden}, random weights (built offline)\n")
    print(f"{'request':34s} {'prompt':>7s} {'reused':>7s} {'cold s':>8s} {'cached s':>9s} {'speedup':>8s}  same")
    total_cold = total_warm = 0.0

    def run(label: str, ids: torch.Tensor) -> torch.Tensor:
        nonlocal total_cold, total_warm
        before = store.stats().hit_tokens
        cold, t_cold = _timed(model, ids, args.new_tokens)
        warm, t_warm = _timed(model, ids, args.new_tokens, past_key_values=store)
        reused = store.stats().hit_tokens - before
        same = torch.equal(cold, warm)
        total_cold, total_warm = total_cold + t_cold, total_warm + t_warm
        print(f"{label:34s} {ids.shape[1]:7d} {reused:7d} {t_cold:8.3f} {t_warm:9.3f} {t_cold / t_warm:7.1f}x  {same}")
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
        f"time {total_cold:.2f}s cold vs {total_warm:.2f}s cached; "
        f"store holds {stats.entries} entries in {stats.nbytes / 2**20:.1f} MiB"
    )


if __name__ == "__main__":
    main()
