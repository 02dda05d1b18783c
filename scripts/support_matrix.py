"""Generate docs/support.md: which transformers model types the store serves exactly.

Every model type of four transformers auto mappings (causal LM, image-text-to-text,
multimodal LM, speech seq2seq) is built as a tiny random-weight model from its config class,
shrunk generically (layers, hidden sizes, heads, vocabulary, experts, in every sub-config),
and put through a fixed scenario, each step compared with a cold run (tokens identical,
logits within 1e-4 in float32):

1. cold: the first prompt through an empty store;
2. hit: a second turn (prompt + answer + new tokens), which should reuse the first;
3. repeat: the second turn again, exactly.

A row says ``served`` (with the hit tokens of steps 2 and 3), ``cold`` with the reasons the
store counted in ``stats().fallbacks``, ``WRONG`` (cached differs from cold: a bug),
``not buildable`` (why) or ``timeout``. Each model type runs in a worker process with a
time limit, so one hanging family does not stop the sweep. A type whose model needs timm reruns
in a worker of its own with `.timm-packages` on its path (`TIMM_PACKAGES`). How each config is
shrunk, and the per-type overrides, live in `support_shrink.py`.

The prompt is random text ids. Types that cannot generate from text ids alone get what their
forward needs besides, from `support_inputs.py` (the same on every call): an encoder-decoder
whose encoder reads audio features, a waveform, pixels or patches gets them as its encoder input
and the prompt as `decoder_input_ids`; a model whose forward needs an image (BLIP-2, Kosmos-2,
Idefics, ...) gets one, with its placeholder ids leading every prompt. A model type whose media
an adapter serves also gets a media cell from `support_media.py`: cold, hit, changed medium and
repeat with the test suite's tiny media model of the family (hit tokens of the last three
steps, or why not served).

Usage::

    OMP_NUM_THREADS=1 python scripts/support_matrix.py            # full sweep, writes docs/support.md
    python scripts/support_matrix.py --only llama,mistral --check # compare those rows with docs/support.md
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import support_inputs
import support_media
import support_pool
import support_shrink
from support_doc import MAPPINGS, Row, parse, render
from support_doc import row_from_line as _row_from_line

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "support.md"
LOGIT_TOL = 1e-4

VOCAB = support_shrink.VOCAB


def model_types() -> dict[str, list[str]]:
    """Every model type of the swept mappings, with the mappings it is in (in `MAPPINGS` order)."""
    from transformers.models.auto import modeling_auto

    types: dict[str, list[str]] = {}
    for label, names, _ in MAPPINGS:
        for model_type in getattr(modeling_auto, names):
            types.setdefault(model_type, []).append(label)
    return dict(sorted(types.items()))


def build(model_type: str, auto_class: str) -> Any:
    """A tiny random-weight float32 eval model of `model_type` through `auto_class`."""
    import torch
    import transformers

    from hf_prefix_cache.model.profile import BIDIRECTIONAL_UNLESS_DECODER

    config_cls = transformers.CONFIG_MAPPING[model_type]
    kwargs = support_shrink.shrunk_kwargs(model_type)
    if model_type in BIDIRECTIONAL_UNLESS_DECODER and auto_class == "AutoModelForCausalLM":
        kwargs["is_decoder"] = True  # as transformers asks for a standalone causal LM of a BERT-style family
    model_cls, config = _model_class(getattr(transformers, auto_class), config_cls(**kwargs))
    torch.manual_seed(0)
    try:
        model = model_cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
    except (ValueError, ImportError):
        model = model_cls._from_config(config, dtype=torch.float32)
    model = model.float().eval()
    if model_type in support_inputs.PREPARE:
        support_inputs.PREPARE[model_type](model)
    gen = getattr(model, "generation_config", None)
    if gen is None:
        return model  # not generative: `_text_row` says so
    gen.eos_token_id, gen.pad_token_id, gen.bos_token_id = None, 0, 1
    gen.do_sample, gen.max_length, gen.min_new_tokens = False, None, None
    gen.temperature = gen.top_p = gen.top_k = None
    return model


def _model_class(auto: Any, config: Any) -> tuple[Any, Any]:
    """The class `auto` builds for `config`, and the config it takes: a sub-config where the class reads one
    (a text config, MusicGen's decoder). Looked up in the mapping itself: `from_config` refuses Evolla's
    config, though its auto mapping names it."""
    model_cls = auto._model_mapping[type(config)]
    wanted = getattr(model_cls, "config_class", None)
    if wanted is not None and not isinstance(config, wanted):
        config = next((sub for sub in vars(config).values() if isinstance(sub, wanted)), config)
    return model_cls, config


def special_ids(config: Any) -> list[int]:
    """Every token id the config (or a sub-config) names: placeholders, separators, pads."""
    found: set[int] = set()

    def walk(value: Any, name: str = "") -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, str(key))
            return
        if name.startswith("forced_") or not name.endswith(("token_id", "token_ids", "token_index")):
            return  # forced ids too: generate refuses to suppress a token it must force
        if isinstance(value, list):
            found.update(v for v in value if isinstance(v, int))
        elif isinstance(value, int) and not isinstance(value, bool):
            found.add(value)

    walk(config.to_dict())
    return sorted(found)


def _prompt_ids(model: Any, count: int, gen: Any) -> Any:
    """`count` random ids in [4, 100) that no config names: text only, never a media placeholder."""
    import torch

    allowed = torch.tensor([i for i in range(4, 100) if i not in set(special_ids(model.config))])
    return allowed[torch.randint(0, len(allowed), (1, count), generator=gen)]


def _generate(model: Any, feed: support_inputs.Feed, ids: Any, store: Any = None) -> Any:
    import torch

    # The same random state for every call: a model whose generate draws noise even when greedy (Diffusion
    # Gemma's block diffusion) then draws the same, cold or cached, and two cold runs agree.
    torch.manual_seed(support_inputs.SEED)
    kwargs: dict[str, Any] = {} if store is None else {"past_key_values": store}
    # Answers never produce a special id either, so later prompts stay text only.
    gen = model.generation_config
    forced: set[Any] = set()  # generate refuses to suppress a token it must force
    for value in (getattr(gen, "forced_eos_token_id", None), getattr(gen, "forced_bos_token_id", None)):
        forced.update(value if isinstance(value, list) else [value])
    kwargs["suppress_tokens"] = [i for i in special_ids(model.config) if 0 <= i < VOCAB and i not in forced] or None
    return model.generate(
        **feed.call(ids),
        max_new_tokens=4,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )


def scenario(model: Any) -> tuple[str, str, str]:
    """(status, detail, hit tokens) of cold / hit / repeat through a store, each against a cold run."""
    import torch

    from hf_prefix_cache import PrefixCache
    from hf_prefix_cache.hooks import family_of

    family = family_of(model)
    if family.encoder_keyed:
        return "not run", f"encoder-decoder ({family.name}): needs the encoder-input scenario", ""
    store = PrefixCache(model)
    feed = support_inputs.feed(model)
    gen = torch.Generator().manual_seed(0)
    first = _prompt_ids(model, 24, gen)
    if feed.head is not None:
        first = torch.cat([feed.head, first], dim=1)
    hits: list[int] = []
    worst = 0.0
    prompts = [first]
    for step in range(3):
        ids = prompts[-1]
        before = store.stats().hit_tokens
        try:
            cold = _generate(model, feed, ids)
        except Exception as exc:  # noqa: BLE001 - the family cannot generate here at all
            return "error", _short(f"cold generate: {type(exc).__name__}: {exc}"), ""
        try:
            warm = _generate(model, feed, ids, store)
        except Exception as exc:  # noqa: BLE001 - cold works, the store's run does not: a bug
            return "WRONG", _short(f"cached generate raised at step {step}: {type(exc).__name__}: {exc}"), ""
        hits.append(store.stats().hit_tokens - before)
        if not torch.equal(cold.sequences, warm.sequences):
            return "WRONG", f"tokens differ at step {step}", ""
        pairs = zip(cold.logits or (), warm.logits or (), strict=True)  # None: block diffusion returns none
        diff = max(((a - b).abs().max().item() for a, b in pairs), default=0.0)
        worst = max(worst, diff)
        if diff >= LOGIT_TOL:
            return "WRONG", f"logits differ by {diff:.2e} at step {step}", ""
        if step == 0:
            more = _prompt_ids(model, 8, gen)
            # The answer joins the prompt where it is ids of the prompt's shape (MusicGen answers in codebook rows).
            answered = feed.answer_in_prompt and warm.sequences.dim() == ids.dim()
            prompts.append(torch.cat([warm.sequences if answered else ids, more], dim=1))
        else:
            prompts.append(ids)
    fallbacks = store.stats().fallbacks
    store.detach()
    if fallbacks:
        return "cold", ", ".join(f"`{k}`" for k in sorted(fallbacks)), ""
    hit_text = f"{hits[1]} / {hits[2]}"
    if hits[2] == 0:
        return "WRONG", f"no reuse and no fallback reason (hits {hit_text})", hit_text
    return "served", "", hit_text


def run_row(model_type: str, mappings: list[str]) -> Row:
    """Build and check one model type (in this process): the text scenario, then its media cases."""
    row = _text_row(model_type, mappings)
    if row.status == "not buildable" and "requires the timm library" in row.detail:
        return support_pool.timm_row(row)
    row.media = support_media.media_cell(model_type, LOGIT_TOL)
    return row


def _text_row(model_type: str, mappings: list[str]) -> Row:
    auto_class = next(a for label, _, a in MAPPINGS if label == mappings[0])
    row = Row(model_type, mappings, "not buildable")
    try:
        model = build(model_type, auto_class)
    except Exception as exc:  # noqa: BLE001 - any build failure is the row's result
        why = BUILD_FAILURES.get(model_type)
        row.detail = _short(f"{why + ': ' if why else ''}{type(exc).__name__}: {exc}")
        return row
    row.model_class = type(model).__name__
    no_generate = not hasattr(model, "generate") or getattr(model, "generation_config", None) is None
    if no_generate or model_type in NOT_GENERATIVE_ALONE:
        row.status, row.detail = "not run", f"not generative: {_not_generative(model)}"
        return row
    try:
        row.status, row.detail, row.hit_tokens = scenario(model)
    except Exception as exc:  # noqa: BLE001 - a crash in generate is recorded, cold or cached alike
        row.status, row.detail = "error", _short(f"{type(exc).__name__}: {exc}")
    return row


#: Why a type's build fails where the reason is transformers' own (said before the exception, where it fails).
_ALL_SHARED = "transformers before 5.25 refuses a model whose every layer is shared, as a drafter's are"
BUILD_FAILURES = {"gemma4_assistant": _ALL_SHARED, "gemma4_unified_assistant": _ALL_SHARED}
_SPEAKS = "its generate speaks: it needs a real checkpoint's speakers (its thinker, row `{thinker}`, writes the text)"
#: Types with a `generate` that cannot run alone, and why (`not run`).
NOT_GENERATIVE_ALONE = {
    "gemma4_assistant": "a drafter: every layer reads the key / value states a Gemma 4 target hands it",
    "gemma4_unified_assistant": "a drafter: every layer reads the key / value states a Gemma 4 target hands it",
    "qwen2_5_omni": _SPEAKS.format(thinker="qwen2_5_omni_thinker"),
    "qwen3_omni_moe": _SPEAKS.format(thinker="qwen3_omni_moe_thinker"),
}


def _not_generative(model: Any) -> str:
    """Why the text scenario cannot call `model`'s generate."""
    if model.config.model_type in NOT_GENERATIVE_ALONE:
        return NOT_GENERATIVE_ALONE[model.config.model_type]
    if hasattr(model, "sample_actions"):
        return "a robotics policy (it samples actions from images and a state, and has no `generate`)"
    return f"`{type(model).__name__}` has no `generate`"


def _short(text: str) -> str:
    text = " ".join(text.split()).replace("|", "/")
    # Which allocation hits the sweep's memory limit varies from run to run; the failure does not.
    text = re.sub(r"you tried to allocate \d+ bytes", "you tried to allocate N bytes", text)
    return text if len(text) <= 160 else text[:157] + "..."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--timm", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--only", help="comma-separated model types (default: all)")
    parser.add_argument("--check", action="store_true", help="compare the rows with docs/support.md, write nothing")
    parser.add_argument("--in-process", action="store_true", help="run rows here, without workers or timeouts")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per model type")
    parser.add_argument("--out", type=Path, default=DOC)
    args = parser.parse_args(argv)
    if args.worker:
        support_pool.worker(args.timm)
        return 0
    types = model_types()
    if args.only:
        wanted = args.only.split(",")
        missing = [t for t in wanted if t not in types]
        if missing:
            parser.error(f"not in the swept mappings: {', '.join(missing)}")
        types = {t: types[t] for t in wanted}
    in_process = [run_row(t, m) for t, m in types.items()] if args.in_process else None
    rows = in_process if in_process is not None else support_pool.sweep(types, args.workers, args.timeout)
    if args.check:
        stored = parse(args.out.read_text())
        stale = [r.model_type for r in rows if stored.get(r.model_type) != r.line()]
        for t in stale:
            print(f"stale: {t}\n  doc: {stored.get(t)}\n  now: {next(r.line() for r in rows if r.model_type == t)}")
        return 1 if stale else 0
    if args.only and args.out.exists():
        # Replace only these rows; the rest stays as last generated.
        old = parse(args.out.read_text())
        merged = {**{t: _row_from_line(line) for t, line in old.items()}, **{r.model_type: r for r in rows}}
        rows = sorted(merged.values(), key=lambda r: r.model_type)
    args.out.write_text(render(rows))
    return 0


if __name__ == "__main__":
    # This checkout's package, not an installed copy (sys.path[0] is scripts/ when run as a script).
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
