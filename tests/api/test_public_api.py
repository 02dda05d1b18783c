"""The package's public surface is declared: `__all__` names exactly what users need, and it all imports."""

from __future__ import annotations

import hf_prefix_cache

USER_NAMES = {
    "PrefixCache",
    "CacheStats",
    "Session",
    "PressureEvent",
    "RequestEvent",
    "Lookup",
    "PrefixCacheError",
    "IncompatibleModelError",
    "UnhashableMediaError",
    "UnsupportedVersionError",
    "ModelUnavailableError",
    "load_smollm2",
    "load_model",
}


def test_all_is_exactly_the_user_surface() -> None:
    assert set(hf_prefix_cache.__all__) == USER_NAMES
    assert len(hf_prefix_cache.__all__) == len(USER_NAMES)  # no duplicates
    for name in hf_prefix_cache.__all__:
        assert getattr(hf_prefix_cache, name) is not None


def test_internals_stay_importable_from_their_modules_but_are_not_exported() -> None:
    from hf_prefix_cache.model.working_cache import WorkingCache
    from hf_prefix_cache.store.tree_store import TreeStore
    from hf_prefix_cache.tree.radix import RadixTree

    for internal in (RadixTree, WorkingCache, TreeStore):
        assert internal.__name__ not in hf_prefix_cache.__all__
    assert not hasattr(hf_prefix_cache, "RadixTree")
    assert not hasattr(hf_prefix_cache, "WorkingCache")


def test_errors_share_one_base() -> None:
    for name in ("IncompatibleModelError", "UnhashableMediaError", "UnsupportedVersionError", "ModelUnavailableError"):
        assert issubclass(getattr(hf_prefix_cache, name), hf_prefix_cache.PrefixCacheError)


def test_every_public_name_has_a_docstring() -> None:
    for name in hf_prefix_cache.__all__:
        assert (getattr(hf_prefix_cache, name).__doc__ or "").strip(), f"{name} has no docstring"
