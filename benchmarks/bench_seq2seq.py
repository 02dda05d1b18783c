"""BART generate: cold vs an exact repeat of the same encoder input through a `PrefixCache`.

Model: a random-weight ``BartForConditionalGeneration`` built from ``BartConfig`` (defaults:
d_model 256, 6 encoder layers, 2 decoder layers, 4 heads, FFN 1024, vocab 32000, 1024
positions), float32, CPU, the default attention implementation, seeded with
``torch.manual_seed(0)``, ``eos_token_id = None`` and no forced EOS (never stops early), greedy.

The variants, measured interleaved in one process on one ``[1, 512]`` encoder input with a
decoder prompt of the start token and 7 more ids (8 tokens):

* ``cold``: ``model.generate(ids, decoder_input_ids=...)`` with no store: the encoder and the
  whole decoder prompt run;
* ``hit``: the same call with ``past_key_values=store``; the store already holds this input
  (generated once through it), so the encoder output is reused (the encoder must not run,
  checked with a forward hook) and the decoder prompt minus its last token is restored
  (checked with ``store.stats().hit_tokens``);
* ``miss``: a new encoder input through a store each repetition: hashing, the encoder,
  storing its output and the decoder states (compare with ``cold``).

Rows for ``max_new_tokens=1`` (time to first token) and ``--gen-tokens`` (16); the greedy tokens
of every variant must equal cold's on the same input (asserted). Medians after a warm-up.

Run: ``PYTHONPATH=. python benchmarks/bench_seq2seq.py --threads 1`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from _common import CACHE, Timings, print_end, print_environment, start_run, timed
from transformers import BartConfig, BartForConditionalGeneration

from hf_prefix_cache import PrefixCache

VARIANTS = ("cold", "hit", "miss")


def build_model(args: argparse.Namespace) -> Any:
    """The random-weight BART described in the module docstring."""
    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        encoder_layers=args.encoder_layers,
        decoder_layers=args.decoder_layers,
        encoder_attention_heads=args.heads,
        decoder_attention_heads=args.heads,
        encoder_ffn_dim=4 * args.d_model,
        decoder_ffn_dim=4 * args.d_model,
        max_position_embeddings=1024,
        forced_eos_token_id=None,
    )
    model: Any = BartForConditionalGeneration(config).to(torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.forced_eos_token_id = None
    model.generation_config.do_sample = False
    return model


def run(model: Any, args: argparse.Namespace, new_tokens: int) -> Timings:
    """Interleave the variants per repetition; raises if a variant reused or encoded other than expected."""
    gen = torch.Generator().manual_seed(1)

    def encoder_input() -> torch.Tensor:
        return torch.randint(4, args.vocab, (1, args.input_len), generator=gen)

    decoder_ids = torch.cat([torch.tensor([[model.config.decoder_start_token_id]]), encoder_input()[:, :7]], dim=1)
    kwargs: dict[str, Any] = {"max_new_tokens": new_tokens, "do_sample": False, "decoder_input_ids": decoder_ids}
    ids = encoder_input()
    stores = {"hit": PrefixCache(model, max_bytes="1GiB"), "miss": PrefixCache(model, max_bytes="1GiB")}
    reference = model.generate(ids, **kwargs)
    model.generate(ids, **{CACHE: stores["hit"]}, **kwargs)  # untimed: the input stored once
    encoder_calls: list[int] = []
    hook = model.get_encoder().register_forward_hook(lambda *_: encoder_calls.append(1))
    expected = {"cold": (0, 1), "hit": (decoder_ids.shape[1] - 1, 0), "miss": (0, 1)}
    timings = Timings()
    for rep in range(args.reps + 1):
        order = VARIANTS[rep % 3 :] + VARIANTS[: rep % 3]
        fresh = encoder_input()
        fresh_tokens = model.generate(fresh, **kwargs)
        for name in order:
            store = stores.get(name)
            before = store.stats().hit_tokens if store is not None else 0
            encoder_calls.clear()
            seconds, out = timed(model.generate, fresh if name == "miss" else ids, **{CACHE: store}, **kwargs)
            reused = store.stats().hit_tokens - before if store is not None else 0
            if (reused, len(encoder_calls)) != expected[name]:
                raise RuntimeError(f"{name}: reused {reused}, encoder ran {len(encoder_calls)}x, not {expected[name]}")
            if not torch.equal(out, fresh_tokens if name == "miss" else reference):
                raise RuntimeError(f"{name}: greedy tokens differ from cold")
            if rep > 0:
                timings.add(name, seconds)
    hook.remove()
    for store in reversed(stores.values()):
        if store.stats().fallbacks:
            raise RuntimeError(f"the store fell back: {store.stats().fallbacks}")
        store.detach()
    return timings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--encoder-layers", type=int, default=6)
    p.add_argument("--decoder-layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--input-len", type=int, default=512, help="encoder input tokens (default 512)")
    p.add_argument("--gen-tokens", type=int, default=16, help="new tokens of the second table (default 16)")
    p.add_argument("--reps", type=int, default=10, help="measured repetitions of every variant (default 10)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--quick", action="store_true", help="small sizes and few repetitions (smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.input_len, args.encoder_layers, args.gen_tokens, args.reps = 64, 2, 4, 2
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = start_run(args.threads)
    model = build_model(args)
    print(
        f"tiny BART: d_model {args.d_model}, {args.encoder_layers} encoder / {args.decoder_layers} decoder layers, "
        f"{args.heads} heads, {args.input_len} encoder input tokens, vocab {args.vocab}; {model.dtype}, "
        f"attn={model.config._attn_implementation}, torch threads={torch.get_num_threads()}"
    )
    print_environment()
    for new_tokens in (1, args.gen_tokens):
        timings = run(model, args, new_tokens)
        print(f"\nmax_new_tokens={new_tokens}, greedy, decoder prompt 8 tokens")
        print(f"  {'variant':<8}{'median ms':>10}{'reps':>6}")
        for name in VARIANTS:
            print(f"  {name:<8}{timings.median(name) * 1e3:10.1f}{timings.reps(name):>6}")
        cold = timings.median("cold")
        print(f"  cold/hit  = {cold / timings.median('hit'):6.2f}x  (exact repeat: encoder output and decoder prefix)")
        print(f"  miss/cold = {timings.median('miss') / cold:6.3f}   (a new input through the store)")
    print_end(started, newline=True)


if __name__ == "__main__":
    main()
