"""Restores from the host and disk tiers: copy bandwidth against raw copies, and break-even against prefill.

Model: the tiny random-weight Llama of ``bench_generate.py`` (defaults: 8 layers, hidden 512,
intermediate 1376, 8 heads, 4 KV heads, vocab 32000, float32, CPU, the default attention
implementation), seeded with ``torch.manual_seed(0)``, ``eos_token_id = None``, greedy. Its
keys/values take ``2 * layers * kv_heads * head_dim * 4`` bytes per token (16 KiB by default).

On a CPU model the "device" is host memory too, so a restore from the host tier measures the
store's copy path (a ``clone`` per layer tensor plus bookkeeping), and a restore from the disk
tier measures reading a safetensors file (from the page cache unless stated), checking its
xxh3 checksum and copying the tensors to the device.

Table 1, one ``--prefix-len`` (2,000) token entry with keys/values from a real prefill:

* ``host tier``: a store with ``max_device_bytes`` = 1.5 entries and a large ``max_host_bytes``;
  the entry is inserted, then a filler entry is inserted so the entry is offloaded to the host
  tier (checked with ``stats()``). Timed: ``store.lookup(ids)`` + ``release`` (acquire: match,
  pin, bring the entry back to the device; then the working cache is built). Between
  repetitions the store's ``relieve_device()`` (untimed) moves it back off the device. Every timed
  restore is checked: ``reloads`` rose by 1 and exactly the entry's bytes left the host tier
  for the device; the first restored keys/values are compared bitwise with the prefill's.
* ``disk tier``: the same with ``disk_dir`` (a temporary folder) and ``max_host_bytes=0``, so
  entries go device -> disk. ``file cache dropped`` variants call
  ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the file first (the guest page cache only; a VM's
  host may still cache it).
* Raw baselines on tensors of the same shapes (``layers`` keys + ``layers`` values, each
  ``[1, kv_heads, prefix_len, head_dim]``): ``clone()`` of each, ``copy_()`` into preallocated
  tensors; ``safetensors.torch.load_file`` of a file holding them (its default mmap backend is
  lazy and reads nothing, so also ``load_file`` + ``clone()`` of each tensor, which brings the
  bytes into memory as the store must, and ``load_file(backend="pread")``); a plain
  ``readinto`` of that file into a preallocated buffer; and the xxh3-128 checksum the disk tier computes on every
  load (``hf_prefix_cache.storage.codec.checksum``), shown as a part of the disk restore.
* ``device tier``: ``lookup`` of the entry while it is on the device (views, no copy).

Table 2, break-even: for each ``--lengths`` L, an entry of L tokens (its own random ids) in a
host-tier store and a disk-tier store. Per repetition and length: a cold prefill of the L
tokens (``model(ids, past_key_values=DynamicCache(), logits_to_keep=1)``, what ``generate``
runs for a prompt), a restore of the entry from the host tier, from the device tier (the same
entry just brought back), and from the disk tier; each restore is ``lookup`` + ``release``,
checked as above. Printed: the smallest L at which each restore beats the prefill.

Exactness (asserted): a ``--prefix-len`` prefix + a ``--suffix-len`` suffix, ``--gen-tokens``
greedy tokens: ``generate`` through the host-tier store and through the disk-tier store (the
prefix entry off the device, brought back, ``hit_tokens`` checked) gives the same tokens as
a cold ``generate``. Finally ``check_integrity()`` of every store.

Every number is the median over repetitions after one warm-up repetition; variants are
interleaved per repetition so that machine noise hits them alike.

Run: ``PYTHONPATH=. python benchmarks/bench_tiers.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import glob
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import CACHE, Timings, print_end, print_environment, start_run, timed, tiny_llama
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.api.prefix_cache import store_of
from hf_prefix_cache.storage.codec import checksum as _checksum

# Token ids below this are left to special tokens; prompts never use them.
_FIRST_ID = 4


class Ids:
    """Random token sequences whose first token is new every time, so stored entries never share a prefix."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self._gen = torch.Generator().manual_seed(seed)
        self._vocab_size = vocab_size
        self._used_first: set[int] = set()

    def fresh(self, length: int) -> torch.Tensor:
        while True:
            ids = torch.randint(_FIRST_ID, self._vocab_size, (1, length), generator=self._gen)
            if int(ids[0, 0]) not in self._used_first:
                self._used_first.add(int(ids[0, 0]))
                return ids


def build_model(args: argparse.Namespace) -> Any:
    """The random-weight tiny Llama of bench_generate.py."""
    return tiny_llama(args, max([args.prefix_len + args.suffix_len + args.gen_tokens, *args.lengths]) + 8)


def prefill(model: Any, ids: torch.Tensor) -> DynamicCache:
    """A cold forward of `ids` on a fresh cache (logits of the last position only, as generate does)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **{CACHE: cache}, use_cache=True, logits_to_keep=1)
    return cache


def kv_of(cache: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]


def store_entry(store: PrefixCache, ids: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Insert `ids` with the given keys/values (by reference; the store never writes into them)."""
    cache = store_of(store).new_cache()
    cache.restore(ids.shape[1], keys, values, None)
    if store.insert(ids, cache) != ids.shape[1]:
        raise RuntimeError(f"the store did not take the {ids.shape[1]}-token entry (over its device budget?)")


def store_filler(store: PrefixCache, ids: torch.Tensor, args: argparse.Namespace) -> None:
    """Insert `ids` with zero keys/values (no forward): an entry that pushes others off the device."""
    shape = (1, args.kv_heads, ids.shape[1], args.hidden // args.heads)
    store_entry(store, ids, *([torch.zeros(shape) for _ in range(args.layers)] for _ in range(2)))


def drop_file_cache(paths: list[str]) -> None:
    """Ask the kernel to drop `paths` from the page cache (clean pages only; a no-op where unsupported)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def store_files(disk_dir: str) -> list[str]:
    return sorted(glob.glob(os.path.join(disk_dir, "*", "*.safetensors")))


class TierRestorer:
    """Times `lookup` + `release` of an entry that sits off the device, checking where it came from."""

    def __init__(self, store: PrefixCache, tier: str) -> None:
        self.store = store
        self.tier = tier  # "host" or "disk"

    def off_device(self) -> None:
        """Move every entry off the device (untimed, between repetitions)."""
        store_of(self.store).relieve_device()

    def restore(self, query: torch.Tensor, length: int, nbytes: int) -> tuple[float, Any]:
        """Seconds of one restore of the `length`-token entry that `query` continues; returns the lookup too."""
        before = self.store.stats()
        if before.device_nbytes:
            raise RuntimeError("the device tier is not empty before a timed restore")
        tier_before = before.host_nbytes if self.tier == "host" else before.disk_nbytes
        if tier_before < nbytes:
            raise RuntimeError(f"the {self.tier} tier holds {tier_before} bytes, less than the {nbytes}-byte entry")
        start = time.perf_counter()
        hit = self.store.lookup(query)
        hit.release()
        seconds = time.perf_counter() - start
        after = self.store.stats()
        tier_after = after.host_nbytes if self.tier == "host" else after.disk_nbytes
        checks = {
            "cached_len": (hit.cached_len, length),
            "reloads": (after.reloads - before.reloads, 1),
            f"{self.tier} bytes out": (tier_before - tier_after, nbytes),
            "device bytes in": (after.device_nbytes - before.device_nbytes, nbytes),
        }
        bad = {k: v for k, v in checks.items() if v[0] != v[1]}
        if bad:
            raise RuntimeError(f"a timed restore from the {self.tier} tier did not do what was planned: {bad}")
        return seconds, hit


def time_device_hit(store: PrefixCache, query: torch.Tensor, length: int) -> float:
    """Seconds of `lookup` + `release` of an entry already on the device (no reload, checked)."""
    before = store.stats().reloads
    start = time.perf_counter()
    hit = store.lookup(query)
    hit.release()
    seconds = time.perf_counter() - start
    if hit.cached_len != length or store.stats().reloads != before:
        raise RuntimeError("the device-tier restore reloaded something or restored another length")
    return seconds


def check_bitwise(hit: Any, keys: list[torch.Tensor], values: list[torch.Tensor], what: str) -> None:
    got_k, got_v = kv_of(hit.cache)
    if not all(torch.equal(a, b) for a, b in zip(got_k + got_v, keys + values, strict=True)):
        raise RuntimeError(f"keys/values restored from the {what} differ from the prefill's")


def run_bandwidth(model: Any, args: argparse.Namespace, ids: Ids, tmp: str) -> Timings:
    """Table 1: restore of one `prefix_len` entry from host and disk vs raw copies of the same bytes."""
    length = args.prefix_len
    query = ids.fresh(length + 1)  # the entry is the first `length` tokens; lookup restores all of them
    entry = query[:, :length]
    keys, values = kv_of(prefill(model, entry))
    tensors = keys + values
    nbytes = sum(t.nbytes for t in tensors)
    disk_dir = os.path.join(tmp, "bandwidth")
    host_store = PrefixCache(model, max_device_bytes=int(nbytes * 1.5), max_host_bytes=args.host_bytes)
    disk_store = PrefixCache(
        model,
        max_device_bytes=int(nbytes * 1.5),
        max_host_bytes=0,
        disk_dir=disk_dir,
        max_disk_bytes=args.disk_bytes,
        save_on_exit=False,
    )
    for store, tier in ((host_store, "host"), (disk_store, "disk")):
        store_entry(store, entry, keys, values)
        store_filler(store, ids.fresh(length), args)  # the entry is now the least recently used: offloaded
        stats = store.stats()
        on_tier = stats.host_nbytes if tier == "host" else stats.disk_nbytes
        if on_tier != nbytes or stats.offloads != 1 or stats.device_nbytes != nbytes:
            raise RuntimeError(f"inserting a filler did not offload the entry to the {tier} tier: {stats}")
        store_of(store).relieve_device()  # the filler too: an empty device, so a restore moves nothing else
    host = TierRestorer(host_store, "host")
    disk = TierRestorer(disk_store, "disk")

    raw_path = os.path.join(tmp, "raw.safetensors")
    save_file({f"{kind}.{i}": t for kind, ts in (("k", keys), ("v", values)) for i, t in enumerate(ts)}, raw_path)
    raw_size = os.path.getsize(raw_path)
    buffer = bytearray(raw_size)
    destinations = [torch.empty_like(t) for t in tensors]

    def read_raw() -> None:
        with open(raw_path, "rb", buffering=0) as f:
            if f.readinto(buffer) != raw_size:
                raise RuntimeError("short read")

    def load_and_clone() -> None:
        for t in load_file(raw_path).values():
            t.clone()

    def copy_raw() -> None:
        for dst, src in zip(destinations, tensors, strict=True):
            dst.copy_(src)

    timings = Timings()
    for rep in range(args.reps + 1):
        record = rep > 0

        def add(name: str, seconds: float, record: bool = record) -> None:
            if record:
                timings.add(name, seconds)

        # Memory copies first, then file reads; the order inside each group alternates.
        memory: list[tuple[str, Callable[[], float]]] = [
            ("host tier", lambda: host.restore(query, length, nbytes)[0]),
            ("clone()", lambda: timed(lambda: [t.clone() for t in tensors])[0]),
            ("copy_()", lambda: timed(copy_raw)[0]),
        ]
        files: list[tuple[str, Callable[[], float]]] = [
            ("disk tier", lambda: disk.restore(query, length, nbytes)[0]),
            ("load_file", lambda: timed(load_file, raw_path)[0]),
            ("load_file+clone", lambda: timed(load_and_clone)[0]),
            ("load_file pread", lambda: timed(load_file, raw_path, backend="pread")[0]),
            ("readinto", lambda: timed(read_raw)[0]),
            ("checksum", lambda: timed(_checksum, {f"t.{i}": t for i, t in enumerate(tensors)}, {})[0]),
        ]
        for group in (memory, files):
            for name, fn in group if rep % 2 == 0 else list(reversed(group)):
                add(name, fn())
                if name in ("host tier", "disk tier"):
                    restorer = host if name == "host tier" else disk
                    if rep == 0:
                        hit = restorer.store.lookup(query)  # on the device now: check it bitwise, then time it
                        check_bitwise(hit, keys, values, f"{restorer.tier} tier")
                        hit.release()
                    if name == "host tier":
                        add("device tier", time_device_hit(host_store, query, length))
                    restorer.off_device()
        # Cold file reads: the page cache of the store's file and of the raw file dropped first.
        drop_file_cache(store_files(disk_dir))
        add("disk tier, cold", disk.restore(query, length, nbytes)[0])
        disk.off_device()
        drop_file_cache([raw_path])
        add("load_file+clone, cold", timed(load_and_clone)[0])
        drop_file_cache([raw_path])
        add("readinto, cold", timed(read_raw)[0])
    timings.samples["_nbytes"] = [float(nbytes)]
    timings.samples["_file_nbytes"] = [float(raw_size)]
    for store in (host_store, disk_store):
        store.check_integrity()
    return timings


def print_bandwidth(timings: Timings, args: argparse.Namespace) -> None:
    nbytes = timings.samples["_nbytes"][0]
    head_dim = args.hidden // args.heads
    print(
        f"\nrestore of one {args.prefix_len}-token entry: {nbytes / 1e6:.1f} MB of keys/values "
        f"({args.layers} layers x K,V x [1, {args.kv_heads}, {args.prefix_len}, {head_dim}] float32); "
        "GB/s = entry bytes / median time"
    )
    rows = [
        ("host tier", "host tier: store.lookup + release (reload + build cache)"),
        ("clone()", "  raw: clone() of the same tensors"),
        ("copy_()", "  raw: copy_() into preallocated tensors"),
        ("disk tier", "disk tier: store.lookup + release (page cache)"),
        ("disk tier, cold", "disk tier: the same, file cache dropped"),
        ("load_file", "  raw: safetensors load_file (mmap: lazy, reads nothing)"),
        ("load_file+clone", "  raw: load_file + clone() of each tensor (page cache)"),
        ("load_file+clone, cold", "  raw: load_file + clone(), file cache dropped"),
        ("load_file pread", "  raw: load_file(backend='pread') (page cache)"),
        ("readinto", "  raw: file readinto a buffer (page cache)"),
        ("readinto, cold", "  raw: file readinto, file cache dropped"),
        ("checksum", "  part of a disk load: xxh3-128 checksum of the tensors"),
        ("device tier", "device tier: store.lookup + release (views)"),
    ]
    print(f"  {'path':<58}{'median ms':>10}{'GB/s':>8}{'reps':>6}")
    for key, label in rows:
        seconds = timings.median(key)
        print(f"  {label:<58}{seconds * 1e3:10.2f}{nbytes / seconds / 1e9:8.2f}{timings.reps(key):>6}")
    host, disk = timings.median("host tier"), timings.median("disk tier")
    print(f"  host tier / clone()             = {host / timings.median('clone()'):6.2f}  (store overhead on the copy)")
    print(f"  disk tier / load_file + clone() = {disk / timings.median('load_file+clone'):6.2f}")
    print(f"  disk tier / readinto            = {disk / timings.median('readinto'):6.2f}")
    print(f"  disk tier / host tier           = {disk / host:6.2f}")


def run_break_even(model: Any, args: argparse.Namespace, ids: Ids, tmp: str) -> tuple[Timings, dict[int, int]]:
    """Table 2: cold prefill of L tokens vs restoring L tokens from the host, device and disk tiers."""
    bytes_per_token = 2 * args.layers * args.kv_heads * (args.hidden // args.heads) * 4
    longest = max(args.lengths)
    device_budget = int(longest * bytes_per_token * 1.5)
    host_store = PrefixCache(model, max_device_bytes=device_budget, max_host_bytes=args.host_bytes)
    disk_store = PrefixCache(
        model,
        max_device_bytes=device_budget,
        max_host_bytes=0,
        disk_dir=os.path.join(tmp, "break_even"),
        max_disk_bytes=args.disk_bytes,
        save_on_exit=False,
    )
    host, disk = TierRestorer(host_store, "host"), TierRestorer(disk_store, "disk")
    queries = {n: ids.fresh(n + 1) for n in args.lengths}
    nbytes = {n: n * bytes_per_token for n in args.lengths}
    timings = Timings()
    for rep in range(args.break_even_reps + 1):
        for n in args.lengths if rep % 2 == 0 else reversed(args.lengths):
            entry = queries[n][:, :n]
            seconds, cache = timed(prefill, model, entry)
            if rep == 0:
                keys, values = kv_of(cache)
                if sum(t.nbytes for t in keys + values) != nbytes[n]:
                    raise RuntimeError("bytes per token differ from 2 * layers * kv_heads * head_dim * 4")
                for store in (host_store, disk_store):
                    store_entry(store, entry, keys, values)
                    store_of(store).relieve_device()
                continue
            timings.add(f"prefill {n}", seconds)
            order = ("host", "disk") if rep % 2 == 0 else ("disk", "host")
            for tier in order:
                restorer = host if tier == "host" else disk
                seconds, _ = restorer.restore(queries[n], n, nbytes[n])
                timings.add(f"{tier} {n}", seconds)
                if tier == "host":
                    timings.add(f"device {n}", time_device_hit(host_store, queries[n], n))
                restorer.off_device()
    for store in (host_store, disk_store):
        store.check_integrity()
    return timings, nbytes


def print_break_even(timings: Timings, nbytes: dict[int, int], args: argparse.Namespace) -> None:
    print(
        f"\nbreak-even: cold prefill of L tokens vs restoring an L-token entry "
        f"(median ms of {args.break_even_reps} repetitions; disk files in the page cache)"
    )
    print(
        f"  {'L':>6}{'KV MB':>8}{'prefill':>10}{'device':>9}{'host':>9}{'disk':>9}"
        f"{'host GB/s':>11}{'disk GB/s':>11}{'prefill/host':>14}{'prefill/disk':>14}"
    )
    wins: dict[str, list[bool]] = {"host": [], "disk": []}
    for n in args.lengths:
        pre, dev, host, disk = (timings.median(f"{v} {n}") for v in ("prefill", "device", "host", "disk"))
        wins["host"].append(host < pre)
        wins["disk"].append(disk < pre)
        print(
            f"  {n:>6}{nbytes[n] / 1e6:8.2f}{pre * 1e3:10.2f}{dev * 1e3:9.3f}{host * 1e3:9.3f}{disk * 1e3:9.3f}"
            f"{nbytes[n] / host / 1e9:11.2f}{nbytes[n] / disk / 1e9:11.2f}{pre / host:14.1f}{pre / disk:14.1f}"
        )
    for tier, won in wins.items():
        # The smallest length from which on the restore wins at every longer measured length too.
        first = next((i for i in range(len(won)) if all(won[i:])), None)
        if first is None:
            print(f"  {tier}: the restore never beats the prefill at every longer measured length")
        elif first == 0:
            print(f"  {tier}: the restore beats the prefill at every measured length (break-even < {args.lengths[0]})")
        else:
            print(f"  {tier}: the restore beats the prefill from L = {args.lengths[first]} on")


def check_exactness(model: Any, args: argparse.Namespace, ids: Ids, tmp: str) -> None:
    """Greedy tokens of generate through a host-tier and a disk-tier restore equal a cold generate's."""
    prefix = ids.fresh(args.prefix_len)
    prompt = torch.cat([prefix, ids.fresh(args.suffix_len)], dim=1)
    kwargs: dict[str, Any] = {"max_new_tokens": args.gen_tokens, "do_sample": False}
    cold = model.generate(prompt, **kwargs)
    keys, values = kv_of(prefill(model, prefix))
    nbytes = sum(t.nbytes for t in keys + values)
    stores = {
        "host": PrefixCache(model, max_device_bytes=int(nbytes * 1.5), max_host_bytes=args.host_bytes),
        "disk": PrefixCache(
            model,
            max_device_bytes=int(nbytes * 1.5),
            max_host_bytes=0,
            disk_dir=os.path.join(tmp, "exactness"),
            max_disk_bytes=args.disk_bytes,
            save_on_exit=False,
        ),
    }
    for tier, store in stores.items():
        store_entry(store, prefix, keys, values)
        store_of(store).relieve_device()
        before = store.stats()
        out = model.generate(prompt, **{CACHE: store}, **kwargs)
        after = store.stats()
        if after.reloads - before.reloads != 1 or after.hit_tokens - before.hit_tokens != args.prefix_len:
            raise RuntimeError(f"the exactness run did not restore the prefix from the {tier} tier: {after}")
        if not torch.equal(out, cold):
            raise AssertionError(f"greedy tokens after a {tier}-tier restore differ from a cold run: {out} vs {cold}")
        store.check_integrity()
    print(
        f"\nexactness: {args.prefix_len}-token prefix restored from the host tier and from the disk tier, "
        f"+ {args.suffix_len}-token suffix, {args.gen_tokens} greedy tokens: identical to a cold generate (asserted)"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1376)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prefix-len", type=int, default=2000, help="tokens of the table-1 entry (default 2000)")
    p.add_argument("--reps", type=int, default=15, help="measured repetitions of table 1 (default 15)")
    p.add_argument(
        "--lengths",
        default="8,16,32,64,128,256,512,1024,2048",
        help="entry lengths of the break-even table (default 8,16,32,64,128,256,512,1024,2048)",
    )
    p.add_argument("--break-even-reps", type=int, default=5, help="measured repetitions of table 2 (default 5)")
    p.add_argument("--suffix-len", type=int, default=16, help="suffix tokens of the exactness check (default 16)")
    p.add_argument("--gen-tokens", type=int, default=8, help="greedy tokens of the exactness check (default 8)")
    p.add_argument("--host-bytes", default="4GiB", help="max_host_bytes of the host-tier stores (default 4GiB)")
    p.add_argument("--disk-bytes", default="4GiB", help="max_disk_bytes of the disk-tier stores (default 4GiB)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--quick", action="store_true", help="small sizes and few repetitions (smoke run, < 20 s)")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.prefix_len, args.reps, args.break_even_reps = 2, 256, 3, 2
        args.lengths, args.suffix_len, args.gen_tokens = "16,64,256", 8, 4
    args.lengths = sorted(int(n) for n in args.lengths.split(","))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = start_run(args.threads)
    model = build_model(args)
    ids = Ids(args.vocab, seed=1)
    print(
        f"tiny Llama: {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, "
        f"{args.heads} heads, {args.kv_heads} KV heads, vocab {args.vocab}, {model.dtype}, "
        f"attn={model.config._attn_implementation}, torch threads={torch.get_num_threads()}"
    )
    print_environment("; the device is the CPU (host memory)")
    with tempfile.TemporaryDirectory(prefix="bench_tiers_") as tmp:
        print(f"disk tier folder: {tmp}")
        print_bandwidth(run_bandwidth(model, args, ids, tmp), args)
        timings, nbytes = run_break_even(model, args, ids, tmp)
        print_break_even(timings, nbytes, args)
        check_exactness(model, args, ids, tmp)
    print_end(started)


if __name__ == "__main__":
    main()
