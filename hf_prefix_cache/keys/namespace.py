"""Namespaces: what identifies reusable work besides the token ids.

The namespace covers what changes the meaning of cached states for the same tokens: the model
class and config, its weights (a fingerprint sampled from every parameter, so two fine-tunes of
one config never share, which matters most for entries persisted on disk), its dtype, active
adapters and an optional user salt that keeps tenants apart. Entries of different namespaces
never share tree nodes. Token ids are compared one by one on every hit, so no hash is ever
trusted alone; the 128-bit xxhash here only fingerprints configurations.
"""

from __future__ import annotations

import json
from typing import Any

import xxhash


def fingerprint(obj: Any) -> str:
    """128-bit xxhash of a JSON-serialisable object, as 32 hex digits."""
    blob = json.dumps(obj, sort_keys=True, default=str).encode()
    return xxhash.xxh3_128_hexdigest(blob)


def sub_namespace(namespace: str, *parts: Any) -> str:
    """The namespace of states that depend on `parts` too (a whole prompt, its media, an encoder input).

    Pure: the same arguments give the same namespace, in every process (entries on disk are
    found again under it). Hooks derive these from the namespace the store answers.

    >>> sub_namespace("ns", "encoder_input", "ab") == fingerprint(["ns", "encoder_input", "ab"])
    True
    """
    return fingerprint([namespace, *parts])


def model_namespace(
    model: Any, salt: str | None = None, weights: str | None = None, adapters: tuple[Any, ...] | None = None
) -> str:
    """The namespace of `model` as it is now (dtype and adapters can change between calls).

    `weights` is the model's `weights_fingerprint` and `adapters` its `adapter_state`, both
    computed by the store when its `WeightsProbe` sees a change.
    """
    config = model.config.to_dict() if hasattr(model.config, "to_dict") else {}
    parts = {
        "class": type(model).__name__,
        "config": fingerprint(config),
        "weights": weights,
        "dtype": str(getattr(model, "dtype", None)),
        "adapters": adapters,
        "salt": salt,
    }
    return fingerprint(parts)
