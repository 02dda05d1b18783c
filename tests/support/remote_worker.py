"""The second process of the remote-tier tests: reuses what the first stored on a shared Redis server.

Builds the same tiny models from the same seed (so their weights fingerprints, hence
namespaces, match the first process's), continues each conversation the first process stored,
and prints, per family, whether the cached run equals a cold one and how much came from the server.

    python tests/support/remote_worker.py redis://127.0.0.1:PORT/0 '{"llama": [[...]], ...}'
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.compare import generate, max_logit_diff
from hf_prefix_cache.testing.media.mllama import IMAGE, SUPPRESS, media, picture, tiny_mllama
from hf_prefix_cache.testing.tiny_models import build, random_prompt

CHUNK = 8
NEW = 5
FAMILIES = ("llama", "bamba", "mllama")  # text, hybrid recurrent, cross-attention VLM


def model_of(family: str) -> Any:
    return tiny_mllama() if family == "mllama" else build(family)


def store_kwargs() -> dict[str, Any]:
    """Chunks of 8 tokens; recurrent snapshots every 8 tokens, so chunk ends carry them."""
    return {"remote_chunk_len": CHUNK, "snapshot_interval": CHUNK}


def extra(family: str, ids: torch.Tensor) -> dict[str, Any]:
    """What generate needs besides the ids: Mllama's image inputs, as its processor builds them."""
    if family == "mllama":
        return {**media(ids, [picture(0)]), "suppress_tokens": SUPPRESS}
    return {}


def first_prompt(family: str) -> torch.Tensor:
    if family == "mllama":
        return torch.cat([random_prompt(5, seed=1), IMAGE, random_prompt(20, seed=2)], dim=1)
    return random_prompt(27, seed=3)


def follow_up(sequences: torch.Tensor) -> torch.Tensor:
    return torch.cat([sequences, random_prompt(6, seed=4)], dim=1)


def main() -> None:
    url, stored = sys.argv[1], json.loads(sys.argv[2])
    results = {}
    for family, sequences in stored.items():
        model = model_of(family)
        store = PrefixCache(model, remote=url, **store_kwargs())
        ids = follow_up(torch.tensor(sequences))
        cold = generate(model, ids, NEW, **extra(family, ids))
        warm = generate(model, ids, NEW, past_key_values=store, **extra(family, ids))
        store.check_integrity()
        stats = store.stats()
        results[family] = {
            "equal": bool(torch.equal(cold.sequences, warm.sequences)),
            "diff": max_logit_diff(cold, warm),
            "hit_tokens": stats.hit_tokens,
            "remote_hit_tokens": stats.remote_hit_tokens,
            "prompt_len": ids.shape[1],
        }
        store.detach()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
