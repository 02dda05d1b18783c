"""Plumbing shared by the benchmark scripts: timing, medians, the tiny Llama, the load average.

Imported as `_common` (the scripts run as `python benchmarks/<script>.py`, so this folder is
on `sys.path`).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from hf_prefix_cache import _compat
from hf_prefix_cache.api.sample_text import HANDBOOK

#: The keyword `generate` and forwards take a cache under on this transformers release (`cache` from 5.24).
CACHE = _compat.CACHE_KWARGS[0] if _compat.CACHE_RENAMED else _compat.CACHE_KWARGS[1]

# transformers 5.25's `from_pretrained` swaps in hub kernels (fused norms, rotary, scans; nothing on CPU) unless
# USE_HUB_KERNELS is false. The benchmarks measure the store against transformers' own kernels, so they are off
# unless the caller sets the variable (USE_HUB_KERNELS=YES python benchmarks/...); every header prints it.
os.environ.setdefault("USE_HUB_KERNELS", "NO")


def hub_kernels() -> str:
    """The hub-kernel setting the run's models load with, as printed beside its figures."""
    return f"USE_HUB_KERNELS={os.environ.get('USE_HUB_KERNELS', 'YES')}"


@dataclass
class Timings:
    """Seconds per call, by variant name, in insertion order."""

    samples: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.samples.setdefault(name, []).append(seconds)

    def median(self, name: str) -> float:
        return statistics.median(self.samples[name])

    def reps(self, name: str) -> int:
        return len(self.samples[name])


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, Any]:
    """Seconds taken by `fn(*args, **kwargs)`, and its result."""
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return time.perf_counter() - start, out


def tiny_llama(args: Any, max_positions: int) -> Any:
    """The random-weight Llama of the benchmarks (sizes from `args`), float32, greedy, never stopping early."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(4096, max_positions),
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    model: Any = LlamaForCausalLM(config)
    model = model.to(torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.generation_config.do_sample = False
    return model


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def start_run(threads: int | None) -> float:
    """Quiet transformers' logging, apply `--threads`, and return the start time."""
    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    if threads is not None:
        torch.set_num_threads(threads)
    return time.perf_counter()


def print_environment(note: str = "") -> None:
    """Versions and the load average at the start (timings on a busy machine are not comparable)."""
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {hub_kernels()}{note}")
    print(f"load average at start: {load_average()} on {os.cpu_count()} CPUs (other processes skew every timing)")


def print_end(started: float, newline: bool = False) -> None:
    """The load average at the end and the whole run's time."""
    lead = "\n" if newline else ""
    print(f"{lead}load average at end: {load_average()}; total time {time.perf_counter() - started:.1f} s")


def system_prompt(tokens: int, tokenizer: Any) -> str:
    """The handbook of `api/sample_text.py` repeated (then cut) to about `tokens` tokens: the shared system prompt of
    the serving benchmarks."""
    text = HANDBOOK
    while len(tokenizer(text).input_ids) < tokens:
        text += "\n" + HANDBOOK
    return str(tokenizer.decode(tokenizer(text).input_ids[:tokens]))
