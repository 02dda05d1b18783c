"""hf_prefix_cache: exact prefix reuse for `transformers` `generate`.

>>> store = PrefixCache(model)                                   # doctest: +SKIP
>>> model.generate(**inputs, past_key_values=store)              # doctest: +SKIP
>>> store.stats().hit_tokens                                     # doctest: +SKIP
"""

from __future__ import annotations

from ._compat import check_transformers

check_transformers()

from .budgets import parse_nbytes  # noqa: E402
from .cache import WorkingCache  # noqa: E402
from .errors import (  # noqa: E402
    IncompatibleModelError,
    PrefixCacheError,
    UnhashableMediaError,
    UnsupportedVersionError,
)
from .keys import PrefixKey  # noqa: E402
from .observe import RequestEvent  # noqa: E402
from .pressure import PressureEvent  # noqa: E402
from .radix import RadixTree  # noqa: E402
from .session import Session  # noqa: E402
from .stats import CacheStats  # noqa: E402
from .store import Lookup, PrefixCache  # noqa: E402

__all__ = [
    "CacheStats",
    "IncompatibleModelError",
    "Lookup",
    "PrefixCache",
    "PrefixCacheError",
    "PrefixKey",
    "PressureEvent",
    "RadixTree",
    "RequestEvent",
    "Session",
    "UnhashableMediaError",
    "UnsupportedVersionError",
    "WorkingCache",
    "parse_nbytes",
]
__version__ = "0.1.0"
