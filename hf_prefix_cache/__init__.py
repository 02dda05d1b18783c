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

from hf_prefix_cache._compat import check_transformers

check_transformers()

from hf_prefix_cache.api.display import CacheStats  # noqa: E402
from hf_prefix_cache.api.models import ModelUnavailableError, load_model, load_smollm2  # noqa: E402
from hf_prefix_cache.api.prefix_cache import PrefixCache  # noqa: E402
from hf_prefix_cache.errors import (  # noqa: E402
    IncompatibleModelError,
    PrefixCacheError,
    UnhashableMediaError,
    UnsupportedVersionError,
)
from hf_prefix_cache.store.lookup import Lookup  # noqa: E402
from hf_prefix_cache.store.observe import RequestEvent  # noqa: E402
from hf_prefix_cache.store.pressure import PressureEvent  # noqa: E402
from hf_prefix_cache.store.sessions import Session  # noqa: E402

__all__ = [
    "CacheStats",
    "IncompatibleModelError",
    "Lookup",
    "ModelUnavailableError",
    "PrefixCache",
    "PrefixCacheError",
    "PressureEvent",
    "RequestEvent",
    "Session",
    "UnhashableMediaError",
    "UnsupportedVersionError",
    "load_model",
    "load_smollm2",
]
__version__ = "0.1.0"
