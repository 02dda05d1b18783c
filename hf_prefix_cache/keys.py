"""PrefixKey and namespaces: what identifies reusable work.

A key is a namespace plus the token ids of a sequence. The namespace covers what changes the
meaning of cached states for the same tokens: the model class and config, its dtype, active
adapters and an optional user salt that keeps tenants apart. Entries of different
namespaces never share tree nodes. Token ids are compared one by one on every hit, so no
hash is ever trusted alone; the 128-bit xxhash here only fingerprints configurations.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import xxhash


@dataclass(frozen=True, slots=True)
class PrefixKey:
    """A sequence's identity in the store."""

    namespace: str
    tokens: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.tokens)


def fingerprint(obj: Any) -> str:
    """128-bit xxhash of a JSON-serialisable object, as 32 hex digits."""
    blob = json.dumps(obj, sort_keys=True, default=str).encode()
    return xxhash.xxh3_128_hexdigest(blob)


def model_namespace(model: Any, salt: str | None = None) -> str:
    """The namespace of `model` as it is now (dtype and adapters can change between calls)."""
    config = model.config.to_dict() if hasattr(model.config, "to_dict") else {}
    adapters: Any = None
    if getattr(model, "peft_config", None):
        try:
            adapters = list(model.active_adapters())
        except (AttributeError, ValueError):
            adapters = sorted(model.peft_config)
    parts = {
        "class": type(model).__name__,
        "config": fingerprint(config),
        "dtype": str(getattr(model, "dtype", None)),
        "adapters": adapters,
        "salt": salt,
    }
    return fingerprint(parts)
