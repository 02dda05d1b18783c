"""Soak: many simulated users chatting (text and images) with one store from several threads.

Model: the tests' tiny random-weight LLaVA (`hf_prefix_cache/testing/tiny_vlms.py`: Llama text model with 2
layers, CLIP tower, 16 placeholders per 32x32 image), float32, one store with all three tiers
under tight budgets (`--device-kb`, `--host-kb`, `--disk-kb`; the disk tier in a temporary
folder). Each of `--threads` threads plays `--users` users in turn; a user's conversation
starts from one of 4 shared system prompts, and each turn adds a user message (with an image,
probability `--image-rate`) and the model's answer (`--new` tokens, greedy), as a processor
would build the next prompt; after `--turns` turns the user starts over.

A share `--check-rate` of requests is also run cold, in the same thread, and compared: tokens
identical and logits within 1e-4, else counted as a mismatch. Every `--integrity-every`
requests the store's `check_integrity` runs (errors counted). After each request the bytes per
tier are sampled for their peaks.

Printed at the end: requests, the token hit rate, mismatches among spot checks, errors,
evictions, offloads, reloads, skipped files, fallbacks and peak bytes per tier.

Run: ``PYTHONPATH=. python benchmarks/soak.py --minutes 10`` (``--quick``: 20 seconds).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import threading
import time
import traceback
from collections import Counter
from typing import Any

import torch
from _common import CACHE, print_end, print_environment, start_run

from hf_prefix_cache import PrefixCache  # noqa: E402
from hf_prefix_cache.testing.tiny_vlm_media import llava_pixels  # noqa: E402
from hf_prefix_cache.testing.tiny_vlm_parts import IMAGE_ID  # noqa: E402
from hf_prefix_cache.testing.tiny_vlms import tiny_llava  # noqa: E402

SPECIAL_IDS = list(range(100, 128))
TOL = 1e-4


class Soak:
    def __init__(self, args: Any, model: Any, store: PrefixCache) -> None:
        self.args, self.model, self.store = args, model, store
        self.lock = threading.Lock()
        self.deadline = time.monotonic() + args.seconds
        self.counts: Counter[str] = Counter()
        self.peaks = [0, 0, 0]
        self.errors: list[str] = []
        gen = torch.Generator().manual_seed(0)
        self.systems = [torch.randint(4, 100, (1, 40 + 10 * i), generator=gen) for i in range(4)]

    def generate(self, ids: torch.Tensor, images: list[torch.Tensor], store: PrefixCache | None) -> Any:
        kwargs: dict[str, Any] = {"pixel_values": torch.stack(images)} if images else {}
        if store is not None:
            kwargs[CACHE] = store
        return self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=self.args.new,
            do_sample=False,
            suppress_tokens=SPECIAL_IDS,
            output_logits=True,
            return_dict_in_generate=True,
            **kwargs,
        )

    def user(self, rng: random.Random, seed: int) -> None:
        ids = self.systems[rng.randrange(len(self.systems))]
        images: list[torch.Tensor] = []
        for _ in range(self.args.turns):
            if time.monotonic() > self.deadline:
                return
            message = torch.randint(4, 100, (1, rng.randint(4, 16)))
            if rng.random() < self.args.image_rate:
                images.append(llava_pixels(rng.randrange(10**6)))
                message = torch.cat([message, torch.full((1, 16), IMAGE_ID), message[:, :3]], dim=1)
            ids = torch.cat([ids, message], dim=1)
            out = self.generate(ids, images, self.store)
            check = rng.random() < self.args.check_rate
            if check:
                cold = self.generate(ids, images, None)
                same = torch.equal(cold.sequences, out.sequences) and all(
                    (a - b).abs().max().item() < TOL for a, b in zip(cold.logits, out.logits, strict=True)
                )
            stats = self.store.stats()
            with self.lock:
                self.counts["requests"] += 1
                self.counts["image_requests"] += bool(images)
                if check:
                    self.counts["checked"] += 1
                    self.counts["mismatches"] += not same
                for tier, nbytes in enumerate((stats.device_nbytes, stats.host_nbytes, stats.disk_nbytes)):
                    self.peaks[tier] = max(self.peaks[tier], nbytes)
                run_integrity = self.counts["requests"] % self.args.integrity_every == 0
            if run_integrity:
                self.store.check_integrity()
            ids = out.sequences

    def worker(self, index: int) -> None:
        rng = random.Random(index)
        users = 0
        while time.monotonic() < self.deadline:
            try:
                self.user(rng, index * 10_000 + users)
            except Exception:
                with self.lock:
                    self.counts["errors"] += 1
                    self.errors.append(traceback.format_exc())
            users += 1
        with self.lock:
            self.counts["users"] += users


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true", help="20 seconds")
    parser.add_argument("--threads", type=int, default=4, help="user threads")
    parser.add_argument("--users", type=int, default=3, help="(informational) users per thread in turn")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--new", type=int, default=8, help="tokens per answer")
    parser.add_argument("--image-rate", type=float, default=0.4)
    parser.add_argument("--check-rate", type=float, default=0.1)
    parser.add_argument("--integrity-every", type=int, default=25)
    parser.add_argument("--device-kb", type=int, default=512)
    parser.add_argument("--host-kb", type=int, default=1024)
    parser.add_argument("--disk-kb", type=int, default=4096)
    parser.add_argument("--torch-threads", type=int, default=1)
    args = parser.parse_args()
    args.seconds = 20.0 if args.quick else args.minutes * 60
    started = start_run(args.torch_threads)
    print_environment()
    model = tiny_llava()
    with tempfile.TemporaryDirectory() as folder:
        store = PrefixCache(
            model,
            max_bytes=args.device_kb * 1024,
            max_host_bytes=args.host_kb * 1024,
            disk_dir=folder,
            max_disk_bytes=args.disk_kb * 1024,
            save_on_exit=False,
        )
        soak = Soak(args, model, store)
        threads = [threading.Thread(target=soak.worker, args=(i,)) for i in range(args.threads)]
        begin = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - begin
        store.check_integrity()
        s = store.stats()
        c = soak.counts
        print(
            f"\n{args.threads} threads, {elapsed / 60:.1f} min, budgets device {args.device_kb} KiB / host "
            f"{args.host_kb} KiB / disk {args.disk_kb} KiB"
        )
        print(f"users started        {c['users']}")
        print(
            f"requests             {c['requests']} ({c['requests'] / elapsed:.1f}/s), {c['image_requests']} with images"
        )
        print(f"token hit rate       {s.hit_rate:.3f} ({s.hit_tokens} of {s.prompt_tokens} prompt tokens)")
        print(f"spot checks          {c['checked']}, mismatches {c['mismatches']}")
        print(f"errors               {c['errors']}")
        print(f"evictions            {s.evictions} ({s.evicted_bytes} bytes)")
        print(f"offloads / reloads   {s.offloads} / {s.reloads}")
        print(f"skipped files        {s.skipped_files}")
        print(f"fallbacks            {dict(s.fallbacks)}")
        print(
            f"peak bytes           device {soak.peaks[0]}, host {soak.peaks[1]}, disk {soak.peaks[2]} "
            f"(budgets {store.budgets})"
        )
        print(f"entries at end       {s.entries} ({s.nbytes} bytes)")
        for err in soak.errors[:3]:
            print(err)
        store.detach()
    print_end(started)


if __name__ == "__main__":
    main()
