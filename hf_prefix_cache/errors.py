"""The exception hierarchy.

    PrefixCacheError
    ├── IncompatibleModelError   the store was built for another model
    ├── ModelUnavailableError    a model loaded by name (the real SmolLM2) is not installed here
    ├── UnhashableMediaError     a media input is of a type we cannot hash (never pickled)
    └── UnsupportedVersionError  transformers is not the version the layer adapters were written for

Caller mistakes that need no type of their own are `ValueError`/`TypeError` with a message
that says what to do. Requests that cannot reuse safely are not errors: they run cold and
are counted in `CacheStats.fallbacks`.
"""

from __future__ import annotations


class PrefixCacheError(Exception):
    """Base class of this package's errors."""


class IncompatibleModelError(PrefixCacheError, ValueError):
    """A store was handed to a model it was not built for."""


class UnhashableMediaError(PrefixCacheError, TypeError):
    """A media input is not a torch tensor, numpy array or PIL image, so it has no content hash."""


class UnsupportedVersionError(PrefixCacheError, ImportError):
    """The installed transformers lacks what the layer adapters rely on."""


class ModelUnavailableError(PrefixCacheError, RuntimeError):
    """A model the front ends load by name cannot be loaded here; the message says why and what to install."""
