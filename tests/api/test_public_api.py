"""The package's public surface is declared: `__all__` names exactly what users need, and it all imports."""

from __future__ import annotations

import hf_prefix_cache

USER_NAMES = {
    "PrefixCache",
    "CacheStats",
    "Session",
    "PressureEvent",
    "RequestEvent",
    "RequestScope",
    "Lookup",
    "PrefixCacheError",
    "IncompatibleModelError",
    "UnhashableMediaError",
    "UnsupportedVersionError",
    "ModelUnavailableError",
    "load_smollm2",
    "load_model",
    "smollm2_folder",
    "HANDBOOK",
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


PREFIX_CACHE_NAMES = {
    # verbs
    "stats",
    "reset_stats",
    "check_integrity",
    "clear",
    "save",
    "invalidate",
    "session",
    "pin",
    "unpin",
    "lookup",
    "insert",
    "on_pressure",
    "on_request",
    "request",
    "detach",
    # properties
    "budgets",
    "max_bytes",
    "model",
}


def test_prefix_cache_shows_only_the_user_verbs() -> None:
    """`PrefixCache` is the user's object: its public names are exactly its verbs and properties."""
    from hf_prefix_cache import PrefixCache
    from hf_prefix_cache.testing.tiny_models import build

    assert {n for n in dir(PrefixCache) if not n.startswith("_")} == PREFIX_CACHE_NAMES
    store = PrefixCache(build("llama"), attach=False)
    assert {n for n in dir(store) if not n.startswith("_")} == PREFIX_CACHE_NAMES
    for name in PREFIX_CACHE_NAMES:
        assert (getattr(PrefixCache, name).__doc__ or "").strip(), f"PrefixCache.{name} has no docstring"
    for hook_verb in ("acquire", "release", "insert_sequence", "record", "namespace", "new_cache"):
        assert not hasattr(store, hook_verb)


def test_prefix_cache_keyword_arguments_are_the_options() -> None:
    """`PrefixCache(model, **options)` takes exactly the fields of `Options`, and rejects anything else."""
    import dataclasses
    import inspect

    import pytest

    from hf_prefix_cache import PrefixCache
    from hf_prefix_cache.store.options import Options
    from hf_prefix_cache.testing.tiny_models import build

    names = [f.name for f in dataclasses.fields(Options)]
    assert list(inspect.signature(PrefixCache).parameters)[1:] == names
    with pytest.raises(TypeError, match="max_byte"):
        PrefixCache(build("llama"), max_byte=1)
