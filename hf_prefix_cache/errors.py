"""The exception hierarchy.

    PrefixCacheError
    ├── IncompatibleModelError   the store was built for another model
    ├── InconsistentStateError   a check between stored states and an exact answer failed
    ├── ModelUnavailableError    a model loaded by name (the real SmolLM2) is not installed here
    ├── UnhashableMediaError     a media input is of a type we cannot hash (never pickled)
    └── UnsupportedVersionError  transformers is not the version the layer adapters were written for

Caller mistakes that need no type of their own are `ValueError`/`TypeError` with a message
that says what to do. Requests that cannot reuse safely are not errors: they run cold and
are counted in `CacheStats.fallbacks`.

Every check that stands between a restore (or a store) and a wrong answer raises
`InconsistentStateError`, never an `assert` (which ``python -O`` removes): the request path
turns it into a cold run, or an entry not stored, counted under a named reason.
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


class InconsistentStateError(PrefixCacheError, RuntimeError):
    """States that should agree do not (lengths, positions, shapes, a snapshot's reach): reusing them could be wrong.

    Raised by the exactness guards, which hold with or without ``python -O``; the message says which
    check failed. Users never see it raised: the request path counts it by where it happened
    (`reasons.INCONSISTENT_RESTORE` before or while a prefix is restored, the request then running
    cold; `reasons.INCONSISTENT_CAPTURE` when a finished request's states are captured to store,
    which are then not stored) and logs it once at WARNING.
    """
