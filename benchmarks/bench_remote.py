"""The remote (Redis) tier against the local disk tier and a cold prefill, on the real SmolLM2-135M.

Model: SmolLM2-135M-Instruct (``hf_prefix_cache.load_smollm2()``, Llama architecture, 30
layers, 3 KV heads of 64, float32, CPU): 46,080 bytes of keys/values per token.

Server: a ``redis-server`` started by this script on a free loopback port with ``--save ''
--appendonly no`` (or ``--url`` for one you run), emptied (``FLUSHALL``, untimed) between
repetitions. Loopback TCP: a network between machines adds its own bandwidth and latency.

Table 1, for each ``--lengths`` L (2,048 and 8,192): an entry of L random token ids whose
keys/values come from a real prefill. Per repetition, interleaved:

* ``prefill``: the cold forward of the L tokens (``logits_to_keep=1``, what generate runs).
* ``remote store``: ``store.insert`` of the entry into a store with ``remote_write="through"``
  (``remote_chunk_len`` 256): the local insert, one ``EXISTS`` pipeline, copying each chunk
  out, safetensors encoding, the checksum and one pipelined ``SET``. Checked: L / 256 chunks
  on the server.
* ``remote load``: ``lookup`` + ``release`` of the entry + 1 token in a fresh store (nothing
  local): one ``EXISTS`` pipeline, one ``MGET``, decoding, checksums and symbol checks, joining
  the chunks and adding them to the tree. Checked: ``cached_len == L`` and the restored
  keys/values equal the prefill's bitwise.
* ``disk store``: ``store.save()`` of the same entry to a ``disk_dir`` (one safetensors file,
  fsynced), in a temporary folder.
* ``disk load``: ``lookup`` + ``release`` of the entry from the disk tier (from the page cache:
  it was just written), checked like the remote load.

GB/s is keys/values bytes over median seconds. ``prefill / load`` > 1 means loading wins.

Table 2, break-even: ``--small-lengths`` L with ``remote_chunk_len`` = the smallest of them:
cold prefill vs remote load as above; prints the smallest L at which the remote load wins.

Every number is the median over ``--reps`` repetitions after one warm-up.

Run: ``PYTHONPATH=. python benchmarks/bench_remote.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Any

import redis
import torch
from _common import CACHE, Timings, print_end, print_environment, start_run, timed
from transformers import DynamicCache

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.api.models import load_smollm2
from hf_prefix_cache.api.prefix_cache import store_of


def start_server() -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed: apt-get install redis-server, or pass --url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url)
    for _ in range(200):
        try:
            client.ping()
            return proc, url
        except redis.exceptions.ConnectionError:
            time.sleep(0.02)
    raise SystemExit("redis-server did not start")


def prefill(model: Any, ids: torch.Tensor) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **{CACHE: cache}, use_cache=True, logits_to_keep=1)
    return cache


def insert(store: PrefixCache, ids: torch.Tensor, cache: DynamicCache) -> None:
    working = store_of(store).new_cache()
    working.restore(ids.shape[1], [lay.keys for lay in cache.layers], [lay.values for lay in cache.layers], None)
    if store.insert(ids, working) != ids.shape[1]:
        raise RuntimeError("the store did not take the entry")


def load(store: PrefixCache, query: torch.Tensor, length: int, cache: DynamicCache) -> float:
    """Seconds of one lookup + release restoring `length` tokens; checks them bitwise against `cache`."""
    seconds, hit = timed(store.lookup, query)
    hit.release()
    if hit.cached_len != length:
        raise RuntimeError(f"restored {hit.cached_len} tokens, expected {length}")
    for got, want in zip(hit.cache.layers, cache.layers, strict=True):
        if not (torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)):
            raise RuntimeError("restored keys/values differ from the prefill's")
    return seconds


def measure(model: Any, url: str, length: int, chunk_len: int, reps: int, disk: bool, seed: int) -> Timings:
    client = redis.Redis.from_url(url)
    ids = torch.randint(4, model.config.vocab_size, (1, length + 1), generator=torch.Generator().manual_seed(seed))
    entry, query = ids[:, :length], ids
    timings = Timings()
    for rep in range(reps + 1):
        client.flushall()
        seconds, cache = timed(prefill, model, entry)
        writer = PrefixCache(model, remote=url, remote_write="through", remote_chunk_len=chunk_len, attach=False)
        store_s, _ = timed(insert, writer, entry, cache)
        if client.dbsize() != length // chunk_len:
            raise RuntimeError(f"{client.dbsize()} chunks on the server, expected {length // chunk_len}")
        reader = PrefixCache(model, remote=url, remote_chunk_len=chunk_len, attach=False)
        load_s = load(reader, query, length, cache)
        if reader.stats().remote_hit_tokens != length:
            raise RuntimeError("the load did not come from the server")
        if rep:  # the first repetition warms up
            timings.add("prefill", seconds)
            timings.add("remote store", store_s)
            timings.add("remote load", load_s)
        del writer, reader
        if disk:
            with tempfile.TemporaryDirectory() as tmp:
                store = PrefixCache(model, disk_dir=tmp, save_on_exit=False, attach=False)
                insert(store, entry, cache)
                disk_store_s, moved = timed(store.save)
                if moved != 1 or store.stats().disk_nbytes == 0:
                    raise RuntimeError("the entry did not move to disk")
                disk_load_s = load(store, query, length, cache)
                if rep:
                    timings.add("disk store", disk_store_s)
                    timings.add("disk load", disk_load_s)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server (default: start redis-server on a free port)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--small-lengths", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--chunk-len", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="lengths 512 and 16/32, 1 repetition")
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.small_lengths, args.reps = [512], [16, 32], 1
    started = start_run(args.threads)
    logging.getLogger("hf_prefix_cache").setLevel(logging.ERROR)
    proc, url = (None, args.url) if args.url else start_server()
    try:
        model, _ = load_smollm2()
        per_token = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * 64 * 4
        print_environment(f", SmolLM2-135M float32 ({per_token} bytes of keys/values per token), server {url}")
        print(f"threads {torch.get_num_threads()}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
        print(f"\nTable 1: one entry, chunks of {args.chunk_len} tokens, median of {args.reps} (seconds; GB/s)")
        header = ["L", "MB", "prefill", "remote store", "remote load", "disk store", "disk load"]
        print(" | ".join(f"{h:>14}" for h in header) + " | prefill/remote load | prefill/disk load")
        for length in args.lengths:
            t = measure(model, url, length, args.chunk_len, args.reps, disk=True, seed=length)
            nbytes = length * per_token
            cells = [f"{length:>14}", f"{nbytes / 1e6:>14.1f}", f"{t.median('prefill'):>13.3f}s"]
            for name in header[3:]:
                cells.append(f"{t.median(name):.3f}s {nbytes / t.median(name) / 1e9:4.2f}GB/s".rjust(14))
            ratios = t.median("prefill") / t.median("remote load"), t.median("prefill") / t.median("disk load")
            print(" | ".join(cells) + f" | {ratios[0]:19.1f} | {ratios[1]:17.1f}")
        chunk = min(args.small_lengths)
        print(f"\nTable 2: break-even, chunks of {chunk} tokens, median of {args.reps}")
        print(f"{'L':>6} | {'prefill':>9} | {'remote load':>11} | prefill/remote load")
        wins = []
        for length in args.small_lengths:
            t = measure(model, url, length, chunk, args.reps, disk=False, seed=length)
            ratio = t.median("prefill") / t.median("remote load")
            wins.append((length, ratio > 1))
            print(f"{length:>6} | {t.median('prefill'):8.4f}s | {t.median('remote load'):10.4f}s | {ratio:19.2f}")
        first_win = next((length for length, won in wins if won), None)
        print(
            f"remote load beats a cold prefill from L = {first_win} tokens"
            if first_win is not None
            else "remote load never beat a cold prefill at these lengths"
        )
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait()
    print_end(started, newline=True)


if __name__ == "__main__":
    main()
