"""Whisper short-form generate: cold vs an exact repeat of the same clip through a `PrefixCache`.

Model: a random-weight ``WhisperForConditionalGeneration`` built from ``WhisperConfig``
(defaults: d_model 256, 4 encoder layers, 2 decoder layers, 4 heads, FFN 1024, 80 mel bins,
1500 encoder positions = 3000 mel frames, the real 30 s window; vocab 51865), float32, CPU,
the default attention implementation, seeded with ``torch.manual_seed(0)``,
``eos_token_id = None`` (never stops early), greedy, ``language="en"``, ``task="transcribe"``
(decoder prompt: start, language, task, no-timestamps = 4 tokens).

The variants, measured interleaved in one process on a ``[1, 80, 3000]`` clip:

* ``cold``: ``model.generate(features, ...)`` with no store: the encoder and the whole decoder run;
* ``hit``: the same call with ``past_key_values=store``; the store already holds this clip
  (generated once through it), so the encoder output is reused (the encoder must not run,
  checked with a forward hook) and the decoder prompt minus its last token is restored
  (checked with ``store.stats().hit_tokens``);
* ``hit, encoder runs``: a store with ``max_encoder_bytes=0``: only decoder states are
  reused and the encoder runs (once): what recomputing the cross-attention input would cost;
* ``miss``: a new clip through a store each repetition: hashing, the encoder, storing the
  encoder output and the decoder states (compare with ``cold``; the clip differs, the work
  does not).

Rows for ``max_new_tokens=1`` (time to first token) and ``--gen-tokens`` (16). ``cold/hit``
is the speedup of an exact repeat; the greedy tokens of every variant must equal cold's on
the same clip (asserted). Medians over repetitions after a warm-up.

Run: ``PYTHONPATH=. python benchmarks/bench_whisper.py --threads 1`` (``--quick`` for a smoke run; one
thread keeps a shared machine's contention from swamping the ratios).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from _common import CACHE, Timings, print_end, print_environment, start_run, timed
from transformers import WhisperConfig, WhisperForConditionalGeneration

from hf_prefix_cache import PrefixCache


def build_model(args: argparse.Namespace) -> Any:
    """The random-weight Whisper described in the module docstring."""
    torch.manual_seed(0)
    sot = args.vocab - 10
    config = WhisperConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        encoder_layers=args.encoder_layers,
        decoder_layers=args.decoder_layers,
        encoder_attention_heads=args.heads,
        decoder_attention_heads=args.heads,
        encoder_ffn_dim=4 * args.d_model,
        decoder_ffn_dim=4 * args.d_model,
        num_mel_bins=80,
        max_source_positions=args.frames // 2,
        max_target_positions=448,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=sot,
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )
    model: Any = WhisperForConditionalGeneration(config).to(torch.float32).eval()
    gen = model.generation_config
    gen.eos_token_id = None
    gen.max_length = None
    gen.do_sample = False
    gen.lang_to_id = {"<|en|>": sot + 1}
    gen.task_to_id = {"transcribe": sot + 2, "translate": sot + 3}
    gen.no_timestamps_token_id = sot + 4
    gen.is_multilingual = True
    return model


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:10.1f}"


def run(model: Any, args: argparse.Namespace, new_tokens: int) -> tuple[Timings, list[str]]:
    """Interleave the variants per repetition; returns timings and the variants whose tokens differed from cold."""
    gen = torch.Generator().manual_seed(1)

    def clip() -> torch.Tensor:
        return torch.randn(1, 80, args.frames, generator=gen)

    kwargs: dict[str, Any] = {"max_new_tokens": new_tokens, "do_sample": False, "language": "en"}
    features = clip()
    # Three stores on one model: each one's hook passes the others' calls through.
    stores = {
        "hit": PrefixCache(model, max_bytes="1GiB"),
        "hit, encoder runs": PrefixCache(model, max_bytes="1GiB", max_encoder_bytes=0),
        "miss": PrefixCache(model, max_bytes="1GiB"),
    }
    reference = model.generate(features, **kwargs)
    for name in ("hit", "hit, encoder runs"):  # untimed: the clip stored once
        model.generate(features, **{CACHE: stores[name]}, **kwargs)
    encoder_calls: list[int] = []
    hook = model.model.encoder.register_forward_hook(lambda *_: encoder_calls.append(1))
    prompt_len = 4  # start, language, task, no-timestamps
    expected = {"cold": (0, 1), "hit": (prompt_len - 1, 0), "hit, encoder runs": (prompt_len - 1, 1), "miss": (0, 1)}
    timings = Timings()
    mismatched: set[str] = set()
    names = list(expected)
    for rep in range(args.reps + 1):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        fresh = clip()  # the miss's new clip, and its cold tokens (untimed)
        fresh_tokens = model.generate(fresh, **kwargs)
        for name in order:
            store = stores.get(name)
            before = store.stats().hit_tokens if store is not None else 0
            encoder_calls.clear()
            clip_features = fresh if name == "miss" else features
            seconds, out = timed(model.generate, clip_features, **{CACHE: store}, **kwargs)
            reused = store.stats().hit_tokens - before if store is not None else 0
            if (reused, len(encoder_calls)) != expected[name]:
                raise RuntimeError(
                    f"{name}: reused {reused} tokens and ran the encoder {len(encoder_calls)} times, "
                    f"expected {expected[name]}"
                )
            if not torch.equal(out, fresh_tokens if name == "miss" else reference):
                mismatched.add(name)
            if rep > 0:
                timings.add(name, seconds)
    hook.remove()
    for store in stores.values():
        if store.stats().fallbacks:
            raise RuntimeError(f"the store fell back: {store.stats().fallbacks}")
    for store in reversed(stores.values()):
        store.detach()
    return timings, sorted(mismatched)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--encoder-layers", type=int, default=4)
    p.add_argument("--decoder-layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=51865)
    p.add_argument("--frames", type=int, default=3000, help="mel frames of the window (default 3000, 30 s)")
    p.add_argument("--gen-tokens", type=int, default=16, help="new tokens of the second table (default 16)")
    p.add_argument("--reps", type=int, default=10, help="measured repetitions of every variant (default 10)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--quick", action="store_true", help="small sizes and few repetitions (smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.frames, args.encoder_layers, args.gen_tokens, args.reps = 600, 2, 4, 2
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = start_run(args.threads)
    model = build_model(args)
    print(
        f"tiny Whisper: d_model {args.d_model}, {args.encoder_layers} encoder / {args.decoder_layers} decoder layers, "
        f"{args.heads} heads, {args.frames} mel frames ({args.frames // 2} encoder positions), vocab {args.vocab}; "
        f"{model.dtype}, attn={model.config._attn_implementation}, torch threads={torch.get_num_threads()}"
    )
    print_environment()
    for new_tokens in (1, args.gen_tokens):
        timings, mismatched = run(model, args, new_tokens)
        print(f"\nmax_new_tokens={new_tokens}, greedy, decoder prompt 4 tokens")
        print(f"  {'variant':<20}{'median ms':>10}{'reps':>6}")
        for name in ("cold", "hit", "hit, encoder runs", "miss"):
            print(f"  {name:<20}{fmt_ms(timings.median(name))}{timings.reps(name):>6}")
        cold, hit = timings.median("cold"), timings.median("hit")
        print(f"  cold/hit            = {cold / hit:6.2f}x  (exact repeat: encoder output and decoder prefix reused)")
        print(f"  cold/(encoder runs) = {cold / timings.median('hit, encoder runs'):6.2f}x  (decoder prefix only)")
        print(f"  miss/cold           = {timings.median('miss') / cold:6.3f}   (a new clip through the store)")
        print(f"  variants whose tokens differ from cold: {mismatched or 'none'}")
        assert not mismatched, f"greedy tokens differ from cold: {mismatched}"
    print_end(started, newline=True)


if __name__ == "__main__":
    main()
