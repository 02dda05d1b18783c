"""Lookup cost vs number of stored entries: the radix tree against linear-scan stores.

Data: ``--prefixes`` (8) system prompts of ``--system-len`` (1,000) random tokens; entry ``i``
is system prompt ``i % prefixes`` followed by a random tail, ``--seq-len`` (2,000) tokens in
all. A query copies the first ``k`` tokens of a random stored entry (``k`` uniform in
``[0, seq-len]``, so it may diverge inside the system prompt, inside the tail, or match the
whole entry) and continues with fresh random tokens up to ``seq-len`` tokens. Every method
must report the same matched length for every query (checked).

Methods, timed per lookup (median over ``--queries`` queries, after one warm-up pass):

* ``radix``:  ``RadixTree.match(namespace, tokens)`` on a tree of all entries (values are a
  fake ``nbytes``/``split`` object). Walks one edge per branch point: cost grows with the
  query length and the depth of the path, not with the number of entries.
* ``scan-py``: what simpler caches do: a list of stored token tuples; for each entry count
  the common prefix with a per-token Python loop, keep the longest.
* ``scan-np``: the same scan vectorised with numpy: entries in one ``[N, seq-len]`` int32
  array, ``(array == query)`` then the first mismatch per row, then the max.
* ``store``: ``TreeStore.acquire(PrefixKey(namespace, tokens), cache)`` + ``TreeStore.release(lease)`` on a
  store (``attach=False``) holding the same entries, for a microscopic Llama (1 layer, 1 KV
  head of dim 2: 16 bytes per token), filled with ``insert_sequence`` from a working cache
  whose keys are views of one zero tensor. Includes pinning the path and gathering the
  key/value views (a ``torch.cat`` when the matched path spans two stored runs) and handing them to
  a working cache (made once, outside the timing).

Also printed while the store grows: ``insert``, the mean time of ``insert_sequence`` per
entry, and ``insert-full``: ``insert_sequence`` of a new entry into a store whose byte budget
is exactly full (so every insert evicts the least recently used leaf).

Run: ``PYTHONPATH=. python benchmarks/bench_lookup.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import transformers
from _common import load_average
from transformers import LlamaConfig, LlamaForCausalLM

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.api.prefix_cache import store_of
from hf_prefix_cache.keys.prefix_key import PrefixKey
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.tree.radix import RadixTree

_NAMESPACE = "bench"
_FIRST_ID = 4


@dataclass(slots=True)
class FakeValue:
    """A tree value of `length` positions, one byte each."""

    length: int

    @property
    def nbytes(self) -> int:
        return self.length

    def split(self, offset: int) -> tuple[FakeValue, FakeValue]:
        return FakeValue(offset), FakeValue(self.length - offset)


class LinearScanStore:
    """The stored token sequences as a list of tuples and as a padded numpy array."""

    def __init__(self, capacity: int, seq_len: int) -> None:
        self.entries: list[tuple[int, ...]] = []
        self.array = np.full((capacity, seq_len), -1, dtype=np.int32)
        self.lengths = np.zeros(capacity, dtype=np.int64)

    def add(self, tokens: Sequence[int]) -> None:
        i = len(self.entries)
        self.entries.append(tuple(tokens))
        self.array[i, : len(tokens)] = tokens
        self.lengths[i] = len(tokens)

    def match_python(self, query: Sequence[int]) -> int:
        """Longest common prefix with any entry, one Python comparison per token."""
        best = 0
        for entry in self.entries:
            n = min(len(entry), len(query))
            i = 0
            while i < n and entry[i] == query[i]:
                i += 1
            best = max(best, i)
        return best

    def match_numpy(self, query: np.ndarray) -> int:
        """Longest common prefix with any entry, vectorised over all entries and positions."""
        count = len(self.entries)
        if count == 0:
            return 0
        width = min(self.array.shape[1], len(query))
        differs = self.array[:count, :width] != query[:width]  # padding (-1) never equals a token
        first = np.where(differs.any(axis=1), differs.argmax(axis=1), width)
        return int(np.minimum(first, self.lengths[:count]).max())


def tiny_store(vocab: int) -> PrefixCache:
    """A store for a 1-layer Llama whose keys and values take 16 bytes per token."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=2,
        intermediate_size=2,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=2,
        max_position_embeddings=4096,
        eos_token_id=None,
        pad_token_id=None,
    )
    model: Any = LlamaForCausalLM(config)
    model.eval()
    return PrefixCache(model, max_bytes="64GiB", attach=False)


class StoreFiller:
    """Inserts token sequences into a `PrefixCache` with zero keys/values, no model forward."""

    def __init__(self, store: PrefixCache, seq_len: int) -> None:
        self.store = store
        self.namespace = store_of(store).namespace()
        self._zeros = torch.zeros(1, 1, seq_len, 2)

    def insert(self, tokens: list[int]) -> None:
        cache = store_of(self.store).new_cache()
        kv = self._zeros[..., : len(tokens), :]
        cache.restore(len(tokens), [kv], [kv], None)
        store_of(self.store).insert_sequence(PrefixKey(self.namespace, tokens), cache, [])


def time_per_query(match: Callable[[Any], int], inputs: Sequence[Any], expected: list[int]) -> float:
    """Median microseconds of `match(x)` over `inputs`, after a short warm-up; checks each result."""
    for x in inputs[:3]:
        match(x)
    samples = []
    for x, want in zip(inputs, expected, strict=False):
        start = time.perf_counter()
        got = match(x)
        samples.append(time.perf_counter() - start)
        if got != want:
            raise RuntimeError(f"matched {got} tokens where the radix tree matched {want}")
    return statistics.median(samples) * 1e6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1,100,1000,10000", help="entry counts to measure at (default 1,100,1000,10000)")
    p.add_argument("--seq-len", type=int, default=2000, help="tokens per entry and per query (default 2000)")
    p.add_argument("--system-len", type=int, default=1000, help="tokens of each shared system prompt (default 1000)")
    p.add_argument("--prefixes", type=int, default=8, help="distinct system prompts (default 8)")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--queries", type=int, default=200, help="queries for radix/store/scan-np (default 200)")
    p.add_argument("--py-queries", type=int, default=20, help="queries for the slow scan-py (default 20)")
    p.add_argument("--no-store", action="store_true", help="skip the PrefixCache acquire/release column")
    p.add_argument("--quick", action="store_true", help="small sizes and few queries (smoke run, < 30 s)")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.queries, args.py_queries = "1,10,100,1000", 30, 5
    return args


def make_queries(
    rng: np.random.Generator, entries: list[list[int]], count: int, args: argparse.Namespace
) -> list[list[int]]:
    """Copies of a random stored entry's first k tokens (k uniform in [0, seq_len]) + fresh random tokens."""
    queries = []
    for _ in range(count):
        base = entries[int(rng.integers(len(entries)))]
        keep = int(rng.integers(0, args.seq_len + 1))
        tail = rng.integers(_FIRST_ID, args.vocab, args.seq_len - keep).tolist()
        queries.append(base[:keep] + tail)
    return queries


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    sizes = sorted(int(s) for s in args.sizes.split(","))
    rng = np.random.default_rng(0)
    systems = [rng.integers(_FIRST_ID, args.vocab, args.system_len).tolist() for _ in range(args.prefixes)]
    tail_len = args.seq_len - args.system_len
    entries = [
        systems[i % args.prefixes] + rng.integers(_FIRST_ID, args.vocab, tail_len).tolist() for i in range(sizes[-1])
    ]

    tree: RadixTree[FakeValue] = RadixTree()
    scan = LinearScanStore(sizes[-1], args.seq_len)
    store = None if args.no_store else tiny_store(args.vocab)
    filler = None if store is None else StoreFiller(store, args.seq_len)
    print(
        f"entries and queries: {args.seq_len} tokens; {args.prefixes} shared system prompts of "
        f"{args.system_len} tokens + random tails; vocab {args.vocab}"
    )
    print(f"load average at start: {load_average()} on {os.cpu_count()} CPUs; numpy {np.__version__}")
    header = f"{'entries':>8} {'radix us':>10} {'store us':>10} {'scan-np us':>11} {'scan-py us':>11}"
    header += f" {'insert us':>10} {'insert-full us':>15} {'tree nodes':>11}"
    print("\nper-lookup median microseconds (2,000-token queries); insert columns: TreeStore.insert_sequence")
    print(header)
    results: dict[int, dict[str, float]] = {}
    filled = 0
    started = time.perf_counter()
    for size in sizes:
        insert_start = time.perf_counter()
        for tokens in entries[filled:size]:
            tree.insert(_NAMESPACE, tokens, lambda a, b: FakeValue(b - a))
            scan.add(tokens)
            if filler is not None:
                filler.insert(tokens)
        insert_us = (time.perf_counter() - insert_start) / max(size - filled, 1) * 1e6
        filled = size
        queries = make_queries(rng, entries[:size], args.queries, args)
        expected = [tree.match(_NAMESPACE, q).matched_len for q in queries]
        arrays = [np.asarray(q, dtype=np.int32) for q in queries]
        row = {
            "radix": time_per_query(functools.partial(_tree_match, tree), queries, expected),
            "scan-np": time_per_query(scan.match_numpy, arrays, expected),
            "scan-py": time_per_query(scan.match_python, queries[: args.py_queries], expected),
        }
        if store is not None and filler is not None:
            acquire = functools.partial(_acquire_release, store, filler.namespace, store_of(store).new_cache())
            row["store"] = time_per_query(acquire, queries, expected)
            row["insert"] = insert_us
            row["insert-full"] = _insert_full(store, filler, rng, entries[:size], args)
        results[size] = row
        cells = [f"{size:>8}", f"{row['radix']:>10.1f}", _cell(row, "store", 10), f"{row['scan-np']:>11.1f}"]
        cells += [f"{row['scan-py']:>11.1f}", _cell(row, "insert", 10), _cell(row, "insert-full", 15)]
        cells.append(f"{tree.num_nodes:>11}")
        print(" ".join(cells))
    first, last = results[sizes[0]], results[sizes[-1]]
    print(f"\nratio {sizes[-1]} entries / {sizes[0]} entr{'y' if sizes[0] == 1 else 'ies'} (1.0 = flat):")
    for name in ("radix", "store", "scan-np", "scan-py", "insert-full"):
        if name in first:
            print(f"  {name:<12} {last[name] / first[name]:8.2f}x")
    print(f"load average at end: {load_average()}; total time {time.perf_counter() - started:.1f} s")


def _tree_match(tree: RadixTree[FakeValue], tokens: list[int]) -> int:
    return tree.match(_NAMESPACE, tokens).matched_len


def _acquire_release(store: PrefixCache, namespace: str, cache: WorkingCache, tokens: list[int]) -> int:
    lease = store_of(store).acquire(PrefixKey(namespace, tokens), cache)  # restores views into the one reused cache
    store_of(store).release(lease)
    return lease.matched_len


def _insert_full(
    store: PrefixCache, filler: StoreFiller, rng: np.random.Generator, stored: list[list[int]], args: argparse.Namespace
) -> float:
    """Median microseconds of inserting a new entry into a store at its byte budget (each insert evicts).

    The new entries start with a reserved id no query starts with, so they never match a query;
    the entries evicted meanwhile are inserted again afterwards, so later sizes find them all.
    """
    budget = store.max_bytes
    samples = []
    try:
        for _ in range(5):
            tokens = [_FIRST_ID - 1] + rng.integers(_FIRST_ID, args.vocab, args.seq_len - 1).tolist()
            store.max_bytes = store.stats().nbytes  # exactly full: this insert must evict
            start = time.perf_counter()
            filler.insert(tokens)
            samples.append(time.perf_counter() - start)
    finally:
        store.max_bytes = budget
    for tokens in stored:
        if _acquire_release(store, filler.namespace, store_of(store).new_cache(), tokens) < len(tokens):
            filler.insert(tokens)
    return statistics.median(samples) * 1e6


def _cell(row: dict[str, float], key: str, width: int) -> str:
    return f"{row[key]:>{width}.1f}" if key in row else f"{'-':>{width}}"


if __name__ == "__main__":
    main()
