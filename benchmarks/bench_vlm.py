"""VLM time-to-first-token: cold prompt vs prefix hit through a `PrefixCache` vs an ideal reuse.

Model: a random-weight ``LlavaForConditionalGeneration`` built from ``LlavaConfig`` (defaults:
CLIP vision tower, 224x224 images, 14x14 patches = 256 patches, 6 layers, hidden 256; Llama
text model, 8 layers, hidden 512, intermediate 1376, 8 heads, 4 KV heads, vocab 32000),
float32, CPU, the default attention implementation, seeded with ``torch.manual_seed(0)``,
``eos_token_id = None``, greedy, ``max_new_tokens=1`` throughout (prompt work only).

Prompt: ``--text-len`` (32) text tokens + image 1 (256 placeholders) + text + image 2 + text,
``pixel_values`` ``[2, 3, 224, 224]``. The variants, measured interleaved in one process:

* ``cold``: ``model.generate(**inputs)`` with no store: both images encoded, all tokens prefilled;
* ``hit``: the same inputs with ``past_key_values=store``; the store already holds the whole
  prompt (it was generated once through the store), so an exact repeat reuses all but the
  last token and the vision tower must not run (checked with a forward hook and with
  ``store.stats().hit_tokens``);
* ``ideal``: a plain ``DynamicCache`` holding the prompt minus its last token (from one full
  forward with ``pixel_values``, cropped, deep-copied per repetition outside the timed region),
  ``generate`` with the full ids and no ``pixel_values``: the floor for ``hit``;
  The deep copy is timed separately and printed for reference: ``hit`` restores the stored
  keys/values into a fresh working cache inside the timed call, ``ideal`` gets its copy free;
* ``hit, 2nd image new``: the store holds text + image 1 + text only (``store.clear()`` and
  that prefix generated once through the store, untimed, before every repetition); the
  prompt's image 2 and last text are the suffix, so exactly one image is encoded (checked);
* ``ideal, 2nd image new``: a ``DynamicCache`` holding that stored prefix, ``generate`` with the
  full ids and image 2's ``pixel_values`` only: the floor for the previous line.

``hit/ideal`` is the store's overhead (target <= 1.05); ``cold/hit`` is the speedup. The greedy
token of every variant must equal cold's (asserted). Medians over repetitions after a warm-up.

Run: ``PYTHONPATH=. python benchmarks/bench_vlm.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from typing import Any

import torch
from _common import CACHE, Timings, print_end, print_environment, start_run, timed
from transformers import DynamicCache, LlavaConfig, LlavaForConditionalGeneration

from hf_prefix_cache import PrefixCache

# Token ids below this are left to special tokens; text never uses them nor the image id.
_FIRST_ID = 4


class TowerCounter:
    """Counts the images the vision tower encodes (its forward's batch size), via a forward hook."""

    def __init__(self, model: Any) -> None:
        self.images = 0
        model.model.vision_tower.register_forward_hook(self._record, with_kwargs=True)

    def _record(self, _module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], _out: Any) -> None:
        first = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
        self.images += int(first.shape[0])


def build_model(args: argparse.Namespace) -> Any:
    """The random-weight LLaVA described in the module docstring."""
    torch.manual_seed(0)
    config = LlavaConfig(
        text_config={
            "model_type": "llama",
            "vocab_size": args.vocab,
            "hidden_size": args.hidden,
            "intermediate_size": args.intermediate,
            "num_hidden_layers": args.layers,
            "num_attention_heads": args.heads,
            "num_key_value_heads": args.kv_heads,
            "max_position_embeddings": 4096,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": None,
        },
        vision_config={
            "model_type": "clip_vision_model",
            "hidden_size": args.vision_hidden,
            "intermediate_size": 4 * args.vision_hidden,
            "num_hidden_layers": args.vision_layers,
            "num_attention_heads": max(1, args.vision_hidden // 64),
            "image_size": args.image_size,
            "patch_size": args.patch_size,
        },
        image_token_index=args.vocab - 1,
        vision_feature_layer=-1,
    )
    model: Any = LlavaForConditionalGeneration(config)
    model = model.to(torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.generation_config.do_sample = False
    return model


def image_tokens(args: argparse.Namespace) -> int:
    """Placeholders per image: one per patch (the default strategy drops CLIP's class token)."""
    return int((args.image_size // args.patch_size) ** 2)


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:10.1f}"


def prefill_cache(model: Any, ids: torch.Tensor, pixel_values: torch.Tensor, keep: int) -> DynamicCache:
    """A `DynamicCache` of one full forward of `ids` with `pixel_values`, cropped to its first `keep` tokens."""
    with torch.no_grad():
        cache: DynamicCache = model(input_ids=ids, pixel_values=pixel_values, use_cache=True).past_key_values
    drop = cache.get_seq_length() - keep
    if drop:
        cache.crop(-drop)  # transformers 5.x: a negative count of tokens to remove from the end
    if cache.get_seq_length() != keep:
        raise RuntimeError(f"cropped cache holds {cache.get_seq_length()} tokens, expected {keep}")
    return cache


def run(model: Any, args: argparse.Namespace) -> tuple[Timings, dict[str, int], int]:
    """Interleave all variants per repetition; returns timings, the greedy tokens and the prompt length."""
    gen = torch.Generator().manual_seed(1)
    image_id = model.config.image_token_index

    def text(n: int) -> torch.Tensor:
        return torch.randint(_FIRST_ID, image_id, (1, n), generator=gen)

    placeholders = torch.full((1, image_tokens(args)), image_id)
    head = torch.cat([text(args.text_len), placeholders, text(args.text_len)], dim=1)  # text + image 1 + text
    ids = torch.cat([head, placeholders, text(args.text_len)], dim=1)
    n = ids.shape[1]
    pixels = torch.rand(2, 3, args.image_size, args.image_size, generator=gen) * 2 - 1
    full = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}
    head_inputs = {"input_ids": head, "attention_mask": torch.ones_like(head), "pixel_values": pixels[:1]}
    kwargs: dict[str, Any] = {"max_new_tokens": 1, "do_sample": False}
    plain_ids = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    # Untimed: the ideal caches and a store holding the whole prompt (for `hit`).
    ideal_cache = prefill_cache(model, ids, pixels, n - 1)
    head_cache = prefill_cache(model, head, pixels[:1], head.shape[1])
    full_store = PrefixCache(model, max_bytes="4GiB")
    model.generate(**full, **{CACHE: full_store}, **kwargs)
    # A second store, cleared and refilled with the head before each `hit, 2nd image new`.
    head_store = PrefixCache(model, max_bytes="4GiB")
    counter = TowerCounter(model)

    def cold() -> Any:
        return model.generate(**full, **kwargs)

    def hit() -> Any:
        return model.generate(**full, **{CACHE: full_store}, **kwargs)

    def ideal() -> Any:
        return model.generate(**plain_ids, **{CACHE: cache}, **kwargs)

    def hit2() -> Any:
        return model.generate(**full, **{CACHE: head_store}, **kwargs)

    def ideal2() -> Any:
        return model.generate(**plain_ids, pixel_values=pixels[1:], **{CACHE: cache}, **kwargs)

    variants: dict[str, tuple[Callable[[], Any], int, int]] = {
        # name: (call, tokens reused from the store, images encoded)
        "cold": (cold, 0, 2),
        "hit": (hit, n - 1, 0),
        "ideal": (ideal, 0, 0),
        "hit, 2nd image new": (hit2, head.shape[1], 1),
        "ideal, 2nd image new": (ideal2, 0, 1),
    }
    timings = Timings()
    tokens: dict[str, int] = {}
    names = list(variants)
    for rep in range(args.reps + 1):
        # Rotate the order so no variant always runs right after the same one.
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for name in order:
            call, expect_reused, expect_images = variants[name]
            # Set-up outside the timed region.
            if name == "ideal":
                copy_seconds, cache = timed(copy.deepcopy, ideal_cache)
                if rep > 0:
                    timings.add("ideal cache deep-copy", copy_seconds)
            elif name == "ideal, 2nd image new":
                cache = copy.deepcopy(head_cache)
            elif name == "hit, 2nd image new":
                head_store.clear()
                model.generate(**head_inputs, **{CACHE: head_store}, **kwargs)
            store = full_store if name == "hit" else head_store
            before_hit, before_images = store.stats().hit_tokens, counter.images

            seconds, out = timed(call)

            reused = store.stats().hit_tokens - before_hit if name.startswith("hit") else 0
            encoded = counter.images - before_images
            if reused != expect_reused or encoded != expect_images:
                raise RuntimeError(
                    f"{name}: reused {reused} tokens and encoded {encoded} images, "
                    f"expected {expect_reused} and {expect_images}"
                )
            token = int(out[0, -1])
            if tokens.setdefault(name, token) != token:
                raise RuntimeError(f"{name}: the greedy token changed between repetitions")
            if rep > 0:
                timings.add(name, seconds)
    for store in (full_store, head_store):
        if store.stats().fallbacks:
            raise RuntimeError(f"the store fell back: {store.stats().fallbacks}")
    full_store.detach()
    head_store.detach()
    return timings, tokens, n


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=8, help="text model layers (default 8)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1376)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--vision-layers", type=int, default=6)
    p.add_argument("--vision-hidden", type=int, default=256)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--patch-size", type=int, default=14)
    p.add_argument("--text-len", type=int, default=32, help="tokens of each of the 3 text runs (default 32)")
    p.add_argument("--reps", type=int, default=15, help="measured repetitions of every variant (default 15)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--quick", action="store_true", help="small sizes and few repetitions (smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.vision_layers, args.image_size, args.text_len, args.reps = 2, 2, 112, 8, 2
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = start_run(args.threads)
    model = build_model(args)
    print(
        f"tiny LLaVA: CLIP tower {args.vision_layers} layers, hidden {args.vision_hidden}, "
        f"{args.image_size}px / patch {args.patch_size} ({image_tokens(args)} tokens per image); "
        f"Llama {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, "
        f"{args.heads} heads, {args.kv_heads} KV heads, vocab {args.vocab}; {model.dtype}, "
        f"attn={model.config._attn_implementation}, torch threads={torch.get_num_threads()}"
    )
    print_environment()

    timings, tokens, n = run(model, args)
    per_image = image_tokens(args)
    print(
        f"\nprompt: {args.text_len} text + image 1 ({per_image}) + {args.text_len} text + image 2 "
        f"({per_image}) + {args.text_len} text = {n} tokens, 2 images; max_new_tokens=1 (TTFT), greedy"
    )
    print(f"  {'variant':<22}{'median ms':>10}{'reps':>6}  reused  images encoded")
    head = 2 * args.text_len + per_image
    notes = {
        "cold": ("0", 2),
        "hit": (f"{n - 1}", 0),
        "ideal": (f"{n - 1}", 0),
        "hit, 2nd image new": (f"{head}", 1),
        "ideal, 2nd image new": (f"{head}", 1),
    }
    for name, (reused, images) in notes.items():
        print(f"  {name:<22}{fmt_ms(timings.median(name))}{len(timings.samples[name]):>6}  {reused:>6}  {images:>14}")
    cold, hit, ideal = (timings.median(x) for x in ("cold", "hit", "ideal"))
    hit2, ideal2 = timings.median("hit, 2nd image new"), timings.median("ideal, 2nd image new")
    print(
        f"  (untimed set-up of ideal: deep-copying its {n - 1}-token cache takes "
        f"{timings.median('ideal cache deep-copy') * 1e3:.2f} ms; hit builds its working cache inside the call)"
    )
    print(f"  hit/ideal   = {hit / ideal:6.3f}   (target <= 1.05; hit - ideal = {(hit - ideal) * 1e3:+.2f} ms)")
    print(f"  cold/hit    = {cold / hit:6.2f}x  (speedup of an exact repeat)")
    print(f"  hit2/ideal2 = {hit2 / ideal2:6.3f}   (2nd image new; hit - ideal = {(hit2 - ideal2) * 1e3:+.2f} ms)")
    print(f"  cold/hit2   = {cold / hit2:6.2f}x  (speedup with the first image and text stored)")
    mismatched = sorted(name for name, token in tokens.items() if token != tokens["cold"])
    print(f"  greedy token: {tokens['cold']} (cold); variants that differ: {mismatched or 'none'}")
    assert not mismatched, f"greedy tokens differ from cold: { {m: tokens[m] for m in mismatched} }"
    print_end(started)


if __name__ == "__main__":
    main()
