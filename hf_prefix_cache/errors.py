"""The exception hierarchy.

    PrefixCacheError
    ├── IncompatibleModelError   the store was built for another model
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


class UnsupportedVersionError(PrefixCacheError, ImportError):
    """The installed transformers lacks what the layer adapters rely on."""
