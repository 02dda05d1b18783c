"""The one registry of media family test builders, keyed as `multimodal.registry` keys the families.

Each builder module of this package registers, beside the fixtures it builds, what a family is
driven by: its support-matrix scenario (`SweepCase`: a tiny model, media "a", "b" and maybe "c"),
and, for the families the parametrised family suite runs, that suite's row (`cases.MediaCase`).
Keys are the media registry's: a model type, or ``"<model type>/<vision model type>"`` for one
tower. `sweep_cases` and `suite_cases` import every module of the package first, so a new family
is its builder module and the rows in it. Knows nothing of the store.

Example:
    >>> from hf_prefix_cache.testing.media import registry
    >>> "qwen2_vl" in registry.sweep_cases()
    True
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hf_prefix_cache.testing.media.cases import MediaCase, ignore_ids, single

#: Medium A's and B's seeds: the fixtures give seeds 1 and 13 the same shape, other content; C's seed.
SEED_A, SEED_B, SEED_C = 1, 13, 2


@dataclass(frozen=True)
class SweepCase:
    """A tiny media model and its media "a", "b" (A's placeholders, other content) and maybe "c"."""

    model: Any
    #: Placeholder tokens, framing included, of each medium by name ("c" absent: no second medium).
    tokens: dict[str, Any]
    #: generate kwargs of a prompt `ids` holding the named media in prompt order.
    kwargs: Callable[[Any, Sequence[str]], dict[str, Any]]
    #: Offset in `tokens["a"]` of A's first placeholder (framing before it is text).
    first: int = 0
    #: Text tokens before medium A (0 where media must lead the prompt: PaliGemma).
    head_len: int = 5
    #: Ids answers must not hold besides the fixtures' 100-127 (media ids past them: Gemma 3n's 128-159).
    suppress: tuple[int, ...] = ()


_SWEEP: dict[str, Callable[[], SweepCase]] = {}
_SUITE: dict[str, Callable[[], MediaCase]] = {}


def _add(table: dict[str, Any], key: str, build: Any) -> None:
    if key in table:
        raise ValueError(f"test builder {key!r} registered twice")
    table[key] = build


def register_sweep(key: str, build: Callable[[], SweepCase]) -> None:
    """Register `build` as the support-matrix scenario of family `key`.

    Raises:
        ValueError: when `key` already has one.
    """
    _add(_SWEEP, key, build)


def register_suite(key: str, build: Callable[[], MediaCase]) -> None:
    """Register `build` as the family suite's row of family `key`.

    Raises:
        ValueError: when `key` already has one.
    """
    _add(_SUITE, key, build)


def media_sweep(
    model: Any,
    placeholders: Callable[[Any], torch.Tensor],
    media: dict[str, Any],
    media_kwargs: Callable[[list[Any]], dict[str, Any]],
    first: int = 0,
) -> SweepCase:
    """The support-matrix scenario of one medium per name (`three`'s), its kwargs built from the named media alone."""
    tokens = {k: placeholders(m) for k, m in media.items()}
    return SweepCase(model, tokens, lambda _ids, names: media_kwargs([media[n] for n in names]), first)


def register_single(
    key: str,
    model: Callable[[], Any],
    kind: str,
    build: Callable[[int], Any],
    placeholders: Callable[[Any], torch.Tensor],
    media_kwargs: Callable[[list[Any]], dict[str, Any]],
    framing: int,
    states: bool = False,
    media: dict[str, Any] | None = None,
) -> None:
    """Register the sweep case and suite row of a family of one kind of medium (`cases.single`), its kwargs built
    from the media alone: the sweep's media `media` (`three(build)` by default), its first placeholder at
    `framing` in each medium's tokens.

    Raises:
        ValueError: when `key` already has either.
    """

    def row() -> MediaCase:
        return dataclasses.replace(
            single(key, model(), kind, build, placeholders, media_kwargs, framing), states=states
        )

    register_sweep(key, lambda: media_sweep(model(), placeholders, media or three(build), media_kwargs, framing))
    register_suite(key, row)


def register_mixed(
    key: str,
    model: Callable[[], Any],
    placeholders: Callable[[Any], torch.Tensor],
    media_kwargs: Callable[[list[Any]], dict[str, Any]],
    kinds: dict[str, Callable[[int], Any]],
    scenario: tuple[str, str, str] = ("image", "audio", "image"),
    states: bool = False,
    suite: bool = True,
) -> None:
    """Register the sweep case (`mixed` media of the `scenario` kinds: by default A an image; C a clip, text, then
    an image) and, where `suite`, the suite row (a builder per kind of `kinds`) of a family whose kwargs are built
    from the media alone.

    Raises:
        ValueError: when `key` already has either.
    """
    first, second, third = (kinds[kind] for kind in scenario)
    register_sweep(
        key,
        lambda: mixed_sweep(model(), placeholders, mixed(first, second, third), lambda _ids, held: media_kwargs(held)),
    )
    if suite:
        register_suite(key, lambda: MediaCase(key, model(), kinds, placeholders, ignore_ids(media_kwargs), states))


class Family(Protocol):
    """A family's fixture builder that makes both its sweep case and its suite row."""

    def sweep(self) -> SweepCase: ...

    def suite(self) -> MediaCase: ...


def register_family(key: str, family: Callable[[], Family], suite: bool = True) -> None:
    """Register the sweep case of `family()` for `key` and, where `suite`, its suite row.

    Raises:
        ValueError: when `key` already has one.
    """
    register_sweep(key, lambda: family().sweep())
    if suite:
        register_suite(key, lambda: family().suite())


def _load() -> None:
    package = importlib.import_module("hf_prefix_cache.testing.media")
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        importlib.import_module(f"{package.__name__}.{info.name}")


def sweep_cases() -> dict[str, Callable[[], SweepCase]]:
    """Family key -> its support-matrix scenario builder (models are built on call)."""
    _load()
    return dict(_SWEEP)


def suite_cases() -> dict[str, Callable[[], MediaCase]]:
    """Family key -> the family suite's row builder (models are built on call)."""
    _load()
    return dict(_SUITE)


def cat(*parts: torch.Tensor) -> torch.Tensor:
    """`parts` joined along the prompt axis, empty ones skipped."""
    return torch.cat([p for p in parts if p.shape[1]], dim=1)


def three(build: Callable[[int], Any]) -> dict[str, Any]:
    """Media "a", "b" and "c" of one builder: seeds `SEED_A`, `SEED_B`, `SEED_C`."""
    return {"a": build(SEED_A), "b": build(SEED_B), "c": build(SEED_C)}


def mixed(
    first: Callable[[int], Any], second: Callable[[int], Any], third: Callable[[int], Any]
) -> dict[str, list[Any]]:
    """Media "a" and "b" one medium of `first` each; "c" a medium of `second`, then one of `third`."""
    return {"a": [first(SEED_A)], "b": [first(SEED_B)], "c": [second(SEED_C), third(SEED_C)]}


def mixed_tokens(placeholders: Callable[[Any], torch.Tensor], media: dict[str, list[Any]]) -> dict[str, Any]:
    """Tokens of `mixed` media: "c" is its two media with two text ids between them."""
    from hf_prefix_cache.testing.tiny_vlm_media import text

    tokens = {k: placeholders(m[0]) for k, m in media.items() if k != "c"}
    tokens["c"] = cat(placeholders(media["c"][0]), text(2, 6), placeholders(media["c"][1]))
    return tokens


def mixed_sweep(
    model: Any,
    placeholders: Callable[[Any], torch.Tensor],
    media: dict[str, list[Any]],
    kwargs: Callable[[Any, list[Any]], dict[str, Any]],
    first: int = 1,
) -> SweepCase:
    """The support-matrix scenario of `mixed` media: `kwargs(ids, media)` builds a prompt's generate kwargs
    from the media it holds, in prompt order; `first` as `SweepCase.first`."""
    return SweepCase(
        model,
        mixed_tokens(placeholders, media),
        lambda ids, names: kwargs(ids, [m for n in names for m in media[n]]),
        first=first,
    )
