"""Decoding modes through the store, cold against a hit, side by side on one model in one run.

Model: the real SmolLM2-135M-Instruct (offline, `load_smollm2`) with its tokenizer and chat
template, float32 on the CPU. Cases, each timed to the end of `generate`:

* ``few-shot batch``: 8 questions after one shared few-shot prefix of about ``--prefix`` tokens
  (a document cut from CPython's `pydoc_data.topics` and three worked examples), as one batch
  left-padded by the tokenizer, greedy, ``--new`` tokens. The store holds the prefix (one earlier
  one-row call, untimed). Rows restore their own stored prefix behind their padding.
* ``self-consistency``: ``--samples`` samples (`num_return_sequences`, `do_sample=True`) of one
  prompt of about ``--prompt`` tokens; the store holds the prompt (one earlier call, untimed).
* ``beams``: ``--beams`` beams on the same prompt, with the prompt stored.
* ``BART beams``: ``--beams`` beams on a small random-weight BART (not SmolLM2: d_model 256, 6
  encoder and 2 decoder layers, 4 heads, vocab 32000, 1,024 positions, float32, seed 0, never
  stopping early) with an encoder input of ``--bart-input`` random ids and the default decoder
  prompt (the start token); the store holds that input (one earlier call), so the hit skips the
  encoder and expands its stored output to the beams.
* ``static + compile``: time to first token (``max_new_tokens=1``) with
  ``cache_implementation="static"`` and ``torch.compile(model.forward, dynamic=False)`` (default
  mode) on a second SmolLM2 instance, run last (``--skip-compile`` leaves it out): the
  self-consistency prompt, the store holding the same document with another question. Every
  shape is compiled before timing (one untimed cold and one untimed hit call).

Each case checks the hit's sequences equal the cold ones (same seed) and prints the positions the
model prefilled (each copy of a row counted: `stats().computed_tokens` times the copies for the hit;
BART: encoder positions), the medians over ``--repeats`` and the cold/hit ratio. ``--plot PATH``
writes those ratios as a small PNG. Run:
``PYTHONPATH=. python benchmarks/bench_modes.py --threads 2 --plot docs/images/bench_modes.png``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, NamedTuple

import torch
from _common import CACHE, Timings, print_end, print_environment, start_run, timed
from transformers import BartConfig, BartForConditionalGeneration

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.api.models import ModelUnavailableError, load_smollm2
from hf_prefix_cache.api.sample_text import FOLLOW_UPS, QUESTIONS

EXAMPLES = (
    ("What does `pass` do?", "Nothing: it is a placeholder where a statement is required."),
    ("When does an `else` after a `for` run?", "When the loop ends without `break`."),
    ("What does `global` change?", "Assignments in the function then bind the module-level name."),
)


class Result(NamedTuple):
    """One case's medians, as printed (and plotted by `--plot`)."""

    name: str
    cold_s: float
    hit_s: float


RESULTS: list[Result] = []


def document(tokenizer: Any, target: int) -> str:
    """About `target` tokens of CPython's own Language Reference (`pydoc_data.topics`), whole topics."""
    from pydoc_data.topics import topics

    parts: list[str] = []
    for name in sorted(topics):
        parts.append(topics[name])
        if len(tokenizer("\n\n".join(parts)).input_ids) >= target:
            break
    text = "\n\n".join(parts)
    ids = tokenizer(text).input_ids[:target]
    return str(tokenizer.decode(ids))


def load() -> tuple[Any, Any]:
    try:
        model, tokenizer = load_smollm2()
    except ModelUnavailableError as exc:
        raise SystemExit(f"this benchmark needs the real model and its tokenizer: {exc}") from None
    model.generation_config.max_length = None
    return model, tokenizer


def chat(tokenizer: Any, system: str, question: str, examples: bool = False) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}]
    if examples:
        for q, a in EXAMPLES:
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return [*messages, {"role": "user", "content": question}]


def encode(tokenizer: Any, chats: list[list[dict[str, str]]]) -> dict[str, torch.Tensor]:
    texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
    tokenizer.padding_side = "left"
    return dict(tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False))


def case(
    name: str,
    model: Any,
    inputs: dict[str, torch.Tensor],
    warm_inputs: dict[str, torch.Tensor],
    kwargs: dict[str, Any],
    repeats: int,
    warm_up: bool = False,
) -> None:
    """Time `generate(**inputs, **kwargs)` cold and through a store holding `warm_inputs`' prompt (a fresh store
    each repetition); `warm_up` runs one untimed repetition first (compiled shapes)."""
    timings = Timings()
    # generate copies each row per beam or sample before the prefill; the stats count prompt rows.
    expand = max(kwargs.get("num_beams", 1), kwargs.get("num_return_sequences", 1))
    encoder = model.config.is_encoder_decoder  # BART: the positions counted are the encoder's
    computed = {"cold": int(inputs["attention_mask"].sum()) * (1 if encoder else expand), "hit": 0}
    for rep in range(repeats + int(warm_up)):
        torch.manual_seed(0)
        seconds, cold = timed(model.generate, **inputs, **kwargs)
        timings.add("cold", seconds)
        store = PrefixCache(model)
        try:
            seed = {k: v for k, v in kwargs.items() if k == "cache_implementation"}
            model.generate(**warm_inputs, max_new_tokens=1, do_sample=False, **seed, **{CACHE: store})
            before = store.stats().computed_tokens, store.stats().encoder_entries
            torch.manual_seed(0)
            seconds, hit = timed(model.generate, **inputs, **kwargs, **{CACHE: store})
            timings.add("hit", seconds)
            stats = store.stats()
            computed["hit"] = (stats.encoder_entries - before[1]) * computed["cold"] if encoder else 0
            computed["hit"] += 0 if encoder else (stats.computed_tokens - before[0]) * expand
            assert stats.fallbacks == {}, stats.fallbacks
            assert stats.hit_tokens > 0 or encoder, f"{name}: the hit reused nothing"
        finally:
            store.detach()
        if not torch.equal(cold, hit):
            sys.exit(f"{name}: the hit's sequences differ from cold")
        if warm_up and rep == 0:
            timings = Timings()
    cold_s, hit_s = timings.median("cold"), timings.median("hit")
    RESULTS.append(Result(name, cold_s, hit_s))
    unit = "encoder positions" if encoder else "positions"
    print(
        f"{name:<18} rows {inputs['input_ids'].shape[0]:>2} x {inputs['input_ids'].shape[1]:>5} tokens | "
        f"cold {cold_s:7.2f} s, {computed['cold']:>6} {unit} | hit {hit_s:7.2f} s, {computed['hit']:>6} {unit} | "
        f"cold/hit {cold_s / hit_s:5.2f}x (median of {repeats})"
    )


def bart(input_len: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """The small random BART of the module docstring and an encoder input of `input_len` random ids."""
    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=32000,
        d_model=256,
        encoder_layers=6,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=1024,
        decoder_ffn_dim=1024,
        max_position_embeddings=1024,
        forced_eos_token_id=None,
    )
    model: Any = BartForConditionalGeneration(config).to(torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.forced_eos_token_id = None
    ids = torch.randint(4, 32000, (1, input_len), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def compiled_static(prompt: dict[str, torch.Tensor], warm: dict[str, torch.Tensor], repeats: int) -> None:
    """Time to first token on a static cache under `torch.compile`, on a SmolLM2 instance of its own."""
    model, _ = load()
    model.forward = torch.compile(model.forward, dynamic=False)
    kwargs = {"max_new_tokens": 1, "do_sample": False, "cache_implementation": "static"}
    try:
        case("static + compile", model, prompt, warm, kwargs, repeats, warm_up=True)
    except Exception as exc:  # a compiler missing or failing here leaves the other cases' figures and plot
        print(f"static + compile   failed: {type(exc).__name__}: {exc}")
    finally:
        torch._dynamo.reset()  # the compiled graphs are this model's: free them


def plot(path: str) -> None:
    """The printed cold/hit ratios as a small horizontal bar chart (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name for r in RESULTS][::-1]
    ratios = [r.cold_s / r.hit_s for r in RESULTS][::-1]
    fig, ax = plt.subplots(figsize=(6.4, 0.45 * len(names) + 1.1), dpi=100)
    ax.barh(names, ratios, color="#4878a8")
    for y, ratio in enumerate(ratios):
        ax.text(ratio, y, f" {ratio:.1f}x", va="center", fontsize=9)
    ax.set_xlabel("cold time / hit time (SmolLM2-135M and a small BART, CPU)")
    ax.set_xlim(0, max(ratios) * 1.18)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", type=int, default=1000, help="few-shot prefix tokens")
    parser.add_argument("--prompt", type=int, default=1500, help="self-consistency and beam prompt tokens")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--new", type=int, default=4, help="new tokens per row")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--bart-input", type=int, default=1000, help="BART encoder input tokens (at most 1,024)")
    parser.add_argument("--skip-compile", action="store_true", help="leave out the static cache under torch.compile")
    parser.add_argument("--plot", metavar="PATH", help="write the cold/hit ratios as a PNG")
    args = parser.parse_args()
    started = start_run(args.threads)
    model, tokenizer = load()
    print_environment(f", {type(model).__name__}")

    questions = [*QUESTIONS, *FOLLOW_UPS][:8]
    prefix_doc = document(tokenizer, args.prefix)
    few_shot = encode(tokenizer, [chat(tokenizer, prefix_doc, q, examples=True) for q in questions])
    warm = encode(tokenizer, [chat(tokenizer, prefix_doc, "Which topics does it cover?", examples=True)])
    case("few-shot batch", model, few_shot, warm, {"max_new_tokens": args.new, "do_sample": False}, args.repeats)

    prompt = encode(tokenizer, [chat(tokenizer, document(tokenizer, args.prompt), questions[0])])
    sampling = {"max_new_tokens": args.new, "do_sample": True, "num_return_sequences": args.samples}
    case("self-consistency", model, prompt, prompt, sampling, args.repeats)
    beams = {"max_new_tokens": args.new, "do_sample": False, "num_beams": args.beams}
    case("beams", model, prompt, prompt, beams, args.repeats)
    bart_model, bart_input = bart(args.bart_input)
    case("BART beams", bart_model, bart_input, bart_input, beams, args.repeats)
    if not args.skip_compile:
        other = encode(tokenizer, [chat(tokenizer, document(tokenizer, args.prompt), "Which topics does it cover?")])
        compiled_static(prompt, other, args.repeats)
    if args.plot:
        plot(args.plot)
    print_end(started, newline=True)


if __name__ == "__main__":
    main()
