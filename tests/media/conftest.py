"""Fixtures of the media tests, over the shared harness (`hf_prefix_cache.testing.media.harness`).

`family_fixture(build, names)` makes a `family` fixture parametrised over family names: the family
`build(name)` returns (with a `.model`) and a store served on that model; `store_fixture(model)`
makes a `store` fixture on one family's model. Either store is checked when the test ends: its
integrity holds and (unless a family's fixture says otherwise) nothing fell back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.media.harness import served


def family_fixture(build: Callable[[str], Any], names: Iterable[Any], *, no_fallbacks: bool = True) -> Any:
    """A fixture yielding (the family of each name, a store served on its model).

    `no_fallbacks=False` checks only the store's integrity (for families whose tests assert their named fallbacks).
    """

    @pytest.fixture(params=list(names))
    def family(request: pytest.FixtureRequest) -> Iterator[tuple[Any, PrefixCache]]:
        fam = build(request.param)
        with served(fam.model, clean=no_fallbacks) as store:
            yield fam, store
            if not no_fallbacks:
                store.check_integrity()

    return family


def store_fixture(model: Callable[[], Any], *, no_fallbacks: bool = True) -> Any:
    """A fixture yielding a store served on `model()` (`no_fallbacks` as for `family_fixture`)."""

    @pytest.fixture
    def store() -> Iterator[PrefixCache]:
        with served(model(), clean=no_fallbacks) as cache:
            yield cache
            if not no_fallbacks:
                cache.check_integrity()

    return store
