"""Check at import that transformers has the cache internals the adapters rely on."""

from __future__ import annotations

import transformers
from packaging.version import Version

from hf_prefix_cache.errors import UnsupportedVersionError

SUPPORTED = ">=5.23,<6"
_REQUIRED_NAMES = (
    "Cache",
    "DynamicCache",
    "DynamicLayer",
    "DynamicSlidingWindowLayer",
    "LinearAttentionLayer",
    "LinearAttentionAndFullAttentionLayer",
    "DummyLayer",
)


def check_transformers() -> None:
    """Raise `UnsupportedVersionError` unless transformers is 5.23 or a later 5.x."""
    version = Version(transformers.__version__)
    if not (Version("5.23") <= version < Version("6")):
        raise UnsupportedVersionError(
            f"hf_prefix_cache needs transformers{SUPPORTED}, found {transformers.__version__}. "
            f"Install a supported version: pip install 'transformers{SUPPORTED}'"
        )
    from transformers import cache_utils

    missing = [name for name in _REQUIRED_NAMES if not hasattr(cache_utils, name)]
    if missing:
        raise UnsupportedVersionError(
            f"transformers {transformers.__version__} lacks {', '.join(missing)} in cache_utils; "
            f"hf_prefix_cache needs transformers{SUPPORTED}"
        )
