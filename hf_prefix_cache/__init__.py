"""hf_prefix_cache: exact prefix reuse for `transformers` `generate`.

>>> store = PrefixCache(model)
>>> for _ in range(2):
...     out = model.generate(ids, cache=store, max_new_tokens=4)
>>> store.stats().hit_tokens  # the second call reused all but the prompt's last token
35

Everything a user needs is exported here. Internals (`RadixTree`, `WorkingCache`, the tiers)
stay importable from their modules for tests and tools, with no promise of stability.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hf_prefix_cache.api.display import CacheStats
    from hf_prefix_cache.api.models import load_model, load_smollm2, smollm2_folder
    from hf_prefix_cache.api.prefix_cache import PrefixCache
    from hf_prefix_cache.api.sample_text import HANDBOOK
    from hf_prefix_cache.errors import (
        IncompatibleModelError,
        ModelUnavailableError,
        PrefixCacheError,
        UnhashableMediaError,
        UnsupportedVersionError,
    )
    from hf_prefix_cache.store.lookup import Lookup
    from hf_prefix_cache.store.observe import RequestEvent
    from hf_prefix_cache.store.pressure import PressureEvent
    from hf_prefix_cache.store.scope import RequestScope
    from hf_prefix_cache.store.sessions import Session

# The public names, imported on first use (PEP 562): importing the package (as the command line
# does for `--help`) loads neither torch nor transformers. The transformers check runs on first use
# of a public name, and again whenever a store is made.
_WHERE = {
    "CacheStats": "hf_prefix_cache.api.display",
    "ModelUnavailableError": "hf_prefix_cache.errors",
    "load_model": "hf_prefix_cache.api.models",
    "load_smollm2": "hf_prefix_cache.api.models",
    "smollm2_folder": "hf_prefix_cache.api.models",
    "HANDBOOK": "hf_prefix_cache.api.sample_text",
    "PrefixCache": "hf_prefix_cache.api.prefix_cache",
    "IncompatibleModelError": "hf_prefix_cache.errors",
    "PrefixCacheError": "hf_prefix_cache.errors",
    "UnhashableMediaError": "hf_prefix_cache.errors",
    "UnsupportedVersionError": "hf_prefix_cache.errors",
    "Lookup": "hf_prefix_cache.store.lookup",
    "RequestEvent": "hf_prefix_cache.store.observe",
    "PressureEvent": "hf_prefix_cache.store.pressure",
    "RequestScope": "hf_prefix_cache.store.scope",
    "Session": "hf_prefix_cache.store.sessions",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'hf_prefix_cache' has no attribute {name!r}")
    if where != "hf_prefix_cache.errors":
        importlib.import_module("hf_prefix_cache._compat").check_transformers()
    value = getattr(importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})


__all__ = [
    "CacheStats",
    "HANDBOOK",
    "IncompatibleModelError",
    "Lookup",
    "ModelUnavailableError",
    "PrefixCache",
    "PrefixCacheError",
    "PressureEvent",
    "RequestEvent",
    "RequestScope",
    "Session",
    "UnhashableMediaError",
    "UnsupportedVersionError",
    "load_model",
    "load_smollm2",
    "smollm2_folder",
]
__version__ = "0.1.0"
