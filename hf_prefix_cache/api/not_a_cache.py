"""What keeps a `PrefixCache` from being mistaken for a transformers `Cache`: a clear error on any Cache method.

transformers never treats a `PrefixCache` as a `Cache` (it is no subclass, and the hook takes
it out of the call). A store passed where no hook takes it (another model's `generate`, a plain
forward) reaches a Cache method first; the error then says how to use it.
"""

from __future__ import annotations

from typing import Any

# Cache methods transformers calls; reaching one means the store was passed where a Cache was expected.
_CACHE_API = frozenset(
    {
        "get_seq_length",
        "update",
        "get_mask_sizes",
        "layers",
        "crop",
        "reorder_cache",
        "update_conv_state",
        "update_recurrent_state",
        "has_previous_state",
        "get_max_length",
        "is_initialized",
        "get_query_offset",
        "is_compileable",
        "is_sliding",
        "early_initialization",
        "batch_size",
    }
)


class _NotAWorkingCacheError(AttributeError):
    """A store was used where transformers expected a Cache."""


def not_a_cache_error(name: str, model: Any) -> AttributeError:
    """The error for attribute `name` of a `PrefixCache` made for `model`: a Cache method says what to do.

    Example:
        >>> not_a_cache_error("get_seq_length", None).args[0][:40]
        "PrefixCache has no 'get_seq_length': it "
        >>> not_a_cache_error("colour", None)
        AttributeError('colour')
    """
    if name not in _CACHE_API:
        return AttributeError(name)
    return _NotAWorkingCacheError(
        f"PrefixCache has no {name!r}: it is a store, not a transformers Cache. Pass it to the generate() "
        f"of the model object it was built for ({type(model).__name__} at {id(model):#x}; another model, "
        "even of the same class, needs its own PrefixCache(model)), or use store.lookup(ids).cache in a "
        "custom forward loop."
    )
