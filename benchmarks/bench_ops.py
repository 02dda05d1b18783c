"""What a hit costs on the device beyond a ready `DynamicCache`: launching ops and host syncs, counted.

On a GPU every non-view operation is a kernel launch (5-10 µs each) and every value read back
to the host drains the stream; a CPU run issues exactly the same operations, so they can be
counted without a GPU. A `TorchDispatchMode` counts the ops and a `TorchFunctionMode` the reads
to the host, for one `generate(max_new_tokens=1)` of a 16-token suffix after a 200-token stored
prefix, and for the same call on a ready `DynamicCache` of that prefix (the ideal). Ops are
split by phase:

* ``before``: outside the model's forwards, before the forward that generate feeds the prompt to
  (restore, bookkeeping, and for hybrids the snapshots of a split prefill);
* ``forward``: inside the model's forwards (a hybrid's split prefill is one forward more);
* ``after``: outside the forwards, after the prompt's forward (storing the sequence).

Printed per model kind (text: Llama; hybrid: Bamba shape, attention on one layer in four,
Mamba-2 elsewhere, with and without `prompt_snapshot`; VLM: LLaVA with an image in the prefix;
text/2: the text model with its stored prefix in two runs) and layer count: the extra
launching ops and syncs of the hit over the ideal per phase, the largest extra ops, and
whether the ``before`` phase is within budget (at most 2 launches per layer + 20, at most 1
sync). `tests/hooks/test_hit_ops.py` runs `count_hit` on a few of these and fails past the budget.

Run: ``PYTHONPATH=. python benchmarks/bench_ops.py`` (about a minute on 2 cores), or
``--kinds text --layers 16`` for one row.
"""

from __future__ import annotations

import argparse
import copy
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from hf_prefix_cache import PrefixCache, _compat
from hf_prefix_cache.testing.tiny_vlm_parts import _CLIP

PREFIX_LEN, SUFFIX_LEN = 200, 16
_CACHE_ARG = "cache" if _compat.CACHE_RENAMED else "past_key_values"
PHASES = ("before", "forward", "after")
# Ops that launch nothing: allocations without a fill, and aliasing that only makes metadata.
_NO_LAUNCH = {
    "aten.empty.memory_format",
    "aten.empty_strided.default",
    "aten.empty_like.default",
    "aten.new_empty.default",
    "aten.new_empty_strided.default",
    "aten.lift_fresh.default",
    "aten.detach.default",
    "aten._local_scalar_dense.default",  # a sync (counted there), not a kernel of its own
}
# Ops whose result the host must wait for (data-dependent sizes or host values).
_SYNC_OPS = {
    "aten._local_scalar_dense.default",
    "aten.equal.default",
    "aten.is_nonzero.default",
    "aten.nonzero.default",
    "aten.masked_select.default",
    "aten.unique_dim.default",
    "aten._unique2.default",
}
# Tensor methods that read a device tensor's values on the host (and `.to("cpu")`).
_SYNC_METHODS = {"tolist", "numpy", "cpu"}


@dataclass
class PhaseCounts:
    """Ops per phase of one call: launching ops by name, and syncs by name."""

    launches: dict[str, Counter[str]] = field(default_factory=lambda: {p: Counter() for p in PHASES})
    syncs: dict[str, Counter[str]] = field(default_factory=lambda: {p: Counter() for p in PHASES})
    num_forwards: int = 0


class _Counter(TorchDispatchMode):
    def __init__(self, counts: PhaseCounts, phase: Callable[[], str]) -> None:
        super().__init__()
        self.counts, self.phase = counts, phase

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        phase = self.phase()
        if not func.is_view and name not in _NO_LAUNCH:
            self.counts.launches[phase][name.removeprefix("aten.").split(".")[0]] += 1
        if name in _SYNC_OPS:
            self.counts.syncs[phase][name.removeprefix("aten.").split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


class _HostReads(TorchFunctionMode):
    def __init__(self, counts: PhaseCounts, phase: Callable[[], str]) -> None:
        super().__init__()
        self.counts, self.phase = counts, phase

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        # `.to("cpu")` reads to the host; `.to(t.device)` stays where `t` is (a CPU run cannot tell them apart).
        to_host = name == "to" and "cpu" in (*args[1:], kwargs.get("device"))
        if name in _SYNC_METHODS or to_host:
            self.counts.syncs[self.phase()][name] += 1
        return func(*args, **kwargs)


@contextmanager
def counting(model: Any) -> Iterator[PhaseCounts]:
    """Count the ops issued inside the block, by phase of `model`'s forwards (see the module docstring)."""
    counts = PhaseCounts()
    depth = [0]
    ops_at_forward: list[tuple[Counter[str], Counter[str]]] = []

    def phase() -> str:
        return "forward" if depth[0] else ("before" if counts.num_forwards == 0 else "after")

    def pre(*_: Any) -> None:
        if depth[0] == 0:
            # Everything outside forwards so far is "before" until a later forward shows this was not the last.
            ops_at_forward.append((counts.launches["after"].copy(), counts.syncs["after"].copy()))
            counts.launches["before"].update(counts.launches["after"])
            counts.syncs["before"].update(counts.syncs["after"])
            counts.launches["after"].clear()
            counts.syncs["after"].clear()
            counts.num_forwards += 1
        depth[0] += 1

    def post(*_: Any) -> None:
        depth[0] -= 1

    handles = [model.register_forward_pre_hook(pre), model.register_forward_hook(post)]
    try:
        with _HostReads(counts, phase), _Counter(counts, phase):
            yield counts
    finally:
        for h in handles:
            h.remove()


@dataclass
class HitOps:
    """Extra ops of a hit over the ideal, per phase; `largest`: biggest extra launching ops before the forward."""

    kind: str
    num_layers: int
    launches: dict[str, int]
    syncs: dict[str, int]
    largest: list[tuple[str, int]]
    extra_forwards: int
    hit_len: int

    @property
    def budget(self) -> int:
        return 2 * self.num_layers + 20

    @property
    def within_budget(self) -> bool:
        return self.launches["before"] <= self.budget and self.syncs["before"] <= 1


# ----------------------------------------------------------------------------- models

_ATTN = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 1024,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": None,
    "tie_word_embeddings": False,
}
_MAMBA2 = {
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "mamba_n_groups": 1,
    "mamba_d_state": 8,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 64,
}
IMAGE_ID, IMAGE_TOKENS = 120, 16


def _finish(model: Any) -> Any:
    model = model.to(torch.float32).eval()
    gen = model.generation_config
    gen.eos_token_id, gen.pad_token_id, gen.do_sample = None, 0, False
    return model


def build(kind: str, num_layers: int, hidden_size: int = 32) -> Any:
    """A tiny random-weight model of `kind` ("text", "hybrid", "vlm") with `num_layers` decoder layers."""
    torch.manual_seed(0)
    if kind == "text":
        config: Any = transformers.LlamaConfig(num_hidden_layers=num_layers, **_ATTN)
        return _finish(transformers.LlamaForCausalLM(config))
    if kind == "hybrid":
        sizes = {**_ATTN, "hidden_size": hidden_size, "intermediate_size": 2 * hidden_size}
        mamba = {**_MAMBA2, "mamba_n_heads": 2 * hidden_size // _MAMBA2["mamba_d_head"]}
        config = transformers.BambaConfig(
            num_hidden_layers=num_layers, attn_layer_indices=list(range(3, num_layers, 4)), **mamba, **sizes
        )
        return _finish(transformers.BambaForCausalLM(config))
    assert kind == "vlm", kind
    config = transformers.LlavaConfig(
        text_config={**_ATTN, "model_type": "llama", "num_hidden_layers": num_layers},
        vision_config=_CLIP,
        image_token_index=IMAGE_ID,
        vision_feature_layer=-1,
    )
    return _finish(transformers.LlavaForConditionalGeneration(config))


def _prompts(kind: str) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """The stored prefix, the whole hit prompt, and the media kwargs of the prompt (VLM: one image in the prefix)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 100, (1, PREFIX_LEN + SUFFIX_LEN), generator=g)
    media: dict[str, Any] = {}
    if kind == "vlm":
        ids[0, 20 : 20 + IMAGE_TOKENS] = IMAGE_ID
        media["pixel_values"] = torch.randn(1, 3, 32, 32, generator=g)
    return ids[:, :PREFIX_LEN], ids, media


# ----------------------------------------------------------------------------- counting


def _call(model: Any, ids: torch.Tensor, cache: Any, media: dict[str, Any]) -> Any:
    # As a tokenizer's output is passed: ids with their all-ones mask.
    mask = torch.ones_like(ids)
    return model.generate(ids, attention_mask=mask, **{_CACHE_ARG: cache}, max_new_tokens=1, **media)


def _ideal_cache(model: Any, prefix: torch.Tensor, media: dict[str, Any]) -> Any:
    """A `DynamicCache` holding `prefix`, as a ready cache would."""
    cache = transformers.DynamicCache(config=model.config.get_text_config())
    with torch.no_grad():
        model(input_ids=prefix, **{_CACHE_ARG: cache}, use_cache=True, **media)
    return cache


def count_hit(kind: str, num_layers: int, branch: bool = False, **store_options: Any) -> HitOps:
    """Count the extra ops of a hit over a ready `DynamicCache` for a `kind` model of `num_layers` layers.

    With `branch` the stored prefix lies in two runs: its first half came with an earlier prompt
    that went on differently, the rest with the prompt stored after it.
    """
    model = build(kind, num_layers)
    prefix, ids, media = _prompts(kind)
    ready = _ideal_cache(model, prefix, media)
    _call(model, ids, copy.deepcopy(ready), {})  # warm transformers' lazy paths
    fresh = copy.deepcopy(ready)
    with counting(model) as ideal:
        _call(model, ids, fresh, {})
    store = PrefixCache(model, **store_options)
    try:
        if branch:
            earlier = prefix.clone()
            earlier[:, PREFIX_LEN // 2 :] = 6  # shares the first half only
            _call(model, earlier, store, media)
        _call(model, prefix, store, media)
        other = ids.clone()
        other[:, PREFIX_LEN:] = 5
        _call(model, other, store, media)  # warm the hit path once, on another suffix
        before = store.stats().hit_tokens
        with counting(model) as hit:
            _call(model, ids, store, media)
        hit_len = store.stats().hit_tokens - before
    finally:
        store.detach()
    launches = {p: sum(hit.launches[p].values()) - sum(ideal.launches[p].values()) for p in PHASES}
    syncs = {p: sum(hit.syncs[p].values()) - sum(ideal.syncs[p].values()) for p in PHASES}
    extra = hit.launches["before"] - ideal.launches["before"]
    return HitOps(
        kind, num_layers, launches, syncs, extra.most_common(4), hit.num_forwards - ideal.num_forwards, hit_len
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", default="text,hybrid,vlm")
    parser.add_argument("--layers", default="16,32,80")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    started = time.perf_counter()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}; "
        f"hit = {SUFFIX_LEN}-token suffix after a {PREFIX_LEN}-token stored prefix, max_new_tokens=1"
    )
    print(
        f"{'kind':>7} {'layers':>6} {'hit':>4} | {'before':>6} {'budget':>6} {'syncs':>5} | "
        f"{'+fwd':>4} {'forward':>7} | {'after':>6} {'syncs':>5} | ok  largest extra before"
    )
    rows: list[tuple[str, dict[str, Any]]] = [(kind, {}) for kind in args.kinds.split(",")]
    if "hybrid" in args.kinds.split(","):
        rows.append(("hybrid", {"prompt_snapshot": False}))
    if "text" in args.kinds.split(","):
        rows.append(("text", {"branch": True}))
    for kind, options in rows:
        label = kind + ("/2" if options.get("branch") else "-" if options else "")
        for num_layers in (int(n) for n in args.layers.split(",")):
            r = count_hit(kind, num_layers, **options)
            largest = ", ".join(f"{name} {n}" for name, n in r.largest)
            print(
                f"{label:>7} {num_layers:>6} {r.hit_len:>4} | {r.launches['before']:>6} {r.budget:>6} "
                f"{r.syncs['before']:>5} | {r.extra_forwards:>4} {r.launches['forward']:>7} | "
                f"{r.launches['after']:>6} {r.syncs['after']:>5} | {'yes' if r.within_budget else 'NO ':3} {largest}"
            )
    print("hybrid-: prompt_snapshot=False (no split prefill, no prompt-end snapshot)")
    print("text/2: the stored prefix lies in two runs (joined by each layer's first update, in its forward)")
    print(f"done in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
