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

Each case checks the hit's sequences equal the cold ones (same seed) and prints the positions the
model prefilled (each copy of a row counted: `stats().computed_tokens` times the copies for the hit),
the medians over
``--repeats`` and the cold/hit ratio. Run: ``PYTHONPATH=. python benchmarks/bench_modes.py --threads 2``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from _common import CACHE, Timings, print_end, print_environment, start_run, timed

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.api.models import ModelUnavailableError, load_smollm2
from hf_prefix_cache.frontends.sample_text import FOLLOW_UPS, QUESTIONS

EXAMPLES = (
    ("What does `pass` do?", "Nothing: it is a placeholder where a statement is required."),
    ("When does an `else` after a `for` run?", "When the loop ends without `break`."),
    ("What does `global` change?", "Assignments in the function then bind the module-level name."),
)


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
) -> None:
    """Time `generate(**inputs, **kwargs)` cold and through a store holding `warm_inputs`' prompt."""
    timings = Timings()
    # generate copies each row per beam or sample before the prefill; the stats count prompt rows.
    expand = max(kwargs.get("num_beams", 1), kwargs.get("num_return_sequences", 1))
    computed = {"cold": int(inputs["attention_mask"].sum()) * expand, "hit": 0}
    for _ in range(repeats):
        torch.manual_seed(0)
        seconds, cold = timed(model.generate, **inputs, **kwargs)
        timings.add("cold", seconds)
        store = PrefixCache(model)
        try:
            model.generate(**warm_inputs, max_new_tokens=1, do_sample=False, **{CACHE: store})
            before = store.stats().computed_tokens
            torch.manual_seed(0)
            seconds, hit = timed(model.generate, **inputs, **kwargs, **{CACHE: store})
            timings.add("hit", seconds)
            computed["hit"] = (store.stats().computed_tokens - before) * expand
            assert store.stats().fallbacks == {}, store.stats().fallbacks
        finally:
            store.detach()
        if not torch.equal(cold, hit):
            sys.exit(f"{name}: the hit's sequences differ from cold")
    cold_s, hit_s = timings.median("cold"), timings.median("hit")
    print(
        f"{name:<18} rows {inputs['input_ids'].shape[0]:>2} x {inputs['input_ids'].shape[1]:>5} tokens | "
        f"cold {cold_s:7.2f} s, {computed['cold']:>6} positions | hit {hit_s:7.2f} s, {computed['hit']:>6} positions | "
        f"cold/hit {cold_s / hit_s:5.2f}x (median of {repeats})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix", type=int, default=1000, help="few-shot prefix tokens")
    parser.add_argument("--prompt", type=int, default=1500, help="self-consistency and beam prompt tokens")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--new", type=int, default=4, help="new tokens per row")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
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
    print_end(started, newline=True)


if __name__ == "__main__":
    main()
