"""Media hash throughput: `hash_media` against raw `xxhash.xxh3_128` over the same bytes.

Data, per case: one media item as the model consumes it (random float32/bfloat16/uint8
tensors, a numpy array, a PIL image), plus a non-contiguous view (which `hash_media` must
copy to CPU-contiguous first). `raw` hashes the item's bytes, already laid out as one
contiguous buffer, with `xxhash.xxh3_128(buffer).intdigest()`: the floor for any content
hash of those bytes. `ours` is `hash_media(item)` (type tag, dtype, shape, bytes streamed into
one hasher). Both are timed as the best of `--repeat` runs of `--number` calls each; the
table shows GB/s and `ours/raw` time (target <= 2.0).

Run: ``PYTHONPATH=. python benchmarks/bench_media_hash.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import os
import timeit
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import xxhash
from PIL import Image

from hf_prefix_cache.multimodal.media import hash_media


def _raw_bytes(item: Any) -> Any:
    """The item's bytes as one contiguous buffer, prepared outside the timed region."""
    if isinstance(item, torch.Tensor):
        return item.contiguous().reshape(-1).view(torch.uint8).numpy()
    if isinstance(item, np.ndarray):
        return np.ascontiguousarray(item).reshape(-1).view(np.uint8)
    return item.tobytes()


def _cases(scale: int) -> list[tuple[str, Any, bool]]:
    g = torch.Generator().manual_seed(0)
    side = 336 * scale
    llava = torch.rand(1, 3, side, side, generator=g)  # one LLaVA image, float32
    anyres = torch.rand(5, 3, side, side, generator=g).to(torch.bfloat16)  # LLaVA-NeXT patches, bfloat16
    qwen_rows = torch.rand(1024 * scale * scale, 1176, generator=g)  # Qwen2-VL flattened patches
    arr = (np.random.default_rng(0).random((side, side, 3)) * 255).astype(np.uint8)
    return [
        ("llava fp32 image", llava, False),
        ("anyres bf16 patches", anyres, False),
        ("qwen2-vl rows fp32", qwen_rows, False),
        ("numpy uint8 HWC", arr, False),
        ("non-contiguous view", llava.transpose(2, 3), True),
        ("PIL RGB image", Image.fromarray(arr), True),
    ]


def _best(fn: Callable[[], Any], number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--number", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--scale", type=int, default=1, help="multiplies image sides (bytes grow with its square)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    number, repeat = (2, 2) if args.quick else (args.number, args.repeat)
    print(f"load average at start: {os.getloadavg()}")
    print(f"{'case':<22} {'MiB':>8} {'raw GB/s':>9} {'ours GB/s':>10} {'ours/raw':>9}")
    worst = 0.0
    for name, item, copies in _cases(args.scale):
        buf = _raw_bytes(item)
        nbytes = memoryview(buf).nbytes if not isinstance(buf, bytes) else len(buf)
        raw = _best(lambda buf=buf: xxhash.xxh3_128(buf).intdigest(), number, repeat)
        ours = _best(lambda item=item: hash_media(item), number, repeat)
        if not copies:
            worst = max(worst, ours / raw)
        note = "  copy" if copies else ""
        print(
            f"{name:<22} {nbytes / 2**20:>8.2f} {nbytes / raw / 1e9:>9.2f} {nbytes / ours / 1e9:>10.2f}"
            f" {ours / raw:>9.2f}{note}"
        )
    print(f"worst ours/raw without a copy: {worst:.2f} (target <= 2.0)")
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
