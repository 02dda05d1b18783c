"""The family suite's row: one `MediaCase` per family the parametrised family suite runs.

A row names a family and builds, on demand, what the suite needs of it: its tiny model, a builder
per kind of medium (``"image"``, ``"video"``, ``"audio"``), the placeholder ids of a medium and the
kwargs a processor would pass for a request's media. Each builder module registers its rows in
`registry` (`registry.register_suite`) under the family's media-registry key, and the suite
(`tests/media/test_media_families.py`) runs every registered row's cases; a new family adds its
builder module and, where it takes other requests, its own test file. Knows nothing of the store:
the suite's assertions live there.

Example:
    >>> from hf_prefix_cache.testing.media.registry import suite_cases
    >>> case = suite_cases()["minicpm_ocr"]()
    >>> case.placeholders(case.media["image"](1)).shape[0]
    1
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


def _one(medium: Any) -> int:
    return 1


def ignore_ids(kwargs: Callable[[list[Any]], dict[str, Any]]) -> Callable[[torch.Tensor, list[Any]], dict[str, Any]]:
    """A family whose media kwargs do not depend on the prompt's ids."""
    return lambda _ids, media: kwargs(media)


@dataclass(frozen=True)
class MediaCase:
    """One family as the family suite drives it.

    Attributes:
        name: The family (the test id).
        model: Its tiny model (built once per process).
        media: A builder per kind of medium: seed -> medium; seeds 1, 13 and 25 give media of equal
            placeholders and other content.
        placeholders: A medium's ids in a prompt, framing included: [1, n].
        kwargs: The media kwargs of a request: (prompt ids, its media in order) -> kwargs.
        states: The text layers hold recurrent states, restored only at a snapshot.
        framing: Text ids before a medium's first placeholder (a begin-of-image id).
        longer: Its turn case also checks a longer turn after the repeat.
        changes: The seeds of the other media its changed-medium case runs after seed 1's.
        repeat: Its changed-medium case ends with seed 1's medium again.
    """

    name: str
    model: Any
    media: Mapping[str, Callable[[int], Any]]
    placeholders: Callable[[Any], torch.Tensor]
    kwargs: Callable[[torch.Tensor, list[Any]], dict[str, Any]]
    states: bool = False
    framing: Callable[[Any], int] = field(default=_one)
    longer: bool = False
    changes: tuple[int, ...] = (13, 25)
    repeat: bool = False


def single(
    name: str,
    model: Any,
    kind: str,
    build: Callable[[int], Any],
    placeholders: Callable[[Any], torch.Tensor],
    kwargs: Callable[[list[Any]], dict[str, Any]],
    framing: int,
) -> MediaCase:
    """A family of one kind of medium built by `build`, its kwargs from the media alone.

    Its changed-medium case runs seed 13's medium, then seed 1's again.
    """
    return MediaCase(
        name,
        model,
        {kind: build},
        placeholders,
        ignore_ids(kwargs),
        framing=lambda _medium: framing,
        changes=(13,),
        repeat=True,
    )
