"""The registry of media family test builders: one `MediaCase` per family the family suite runs.

A row names a family and builds, on demand, what the suite needs of it: its tiny model, a builder
per kind of medium (``"image"``, ``"video"``, ``"audio"``), the placeholder ids of a medium and the
kwargs a processor would pass for a request's media. The suite (`tests/media/test_media_families.py`)
runs every row's cases; a new family adds its builder module, one row here and, where it takes
other requests, its own test file. Knows nothing of the store: the suite's assertions live there.

Example:
    >>> from hf_prefix_cache.testing.media.cases import CASES
    >>> case = CASES["minicpm_ocr"]()
    >>> case.placeholders(case.media["image"](1)).shape[0]
    1
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from hf_prefix_cache.testing.media import emu3, grid, inkling, moss, nemotron_h_omni, ovis2, packed, qwen3, vibevoice


def _one(medium: Any) -> int:
    return 1


def _ignore_ids(kwargs: Callable[[list[Any]], dict[str, Any]]) -> Callable[[torch.Tensor, list[Any]], dict[str, Any]]:
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


def _grid(name: str) -> MediaCase:
    fam = grid.GridFamily(name)
    return MediaCase(
        name,
        fam.model,
        {"image": fam.image, "video": fam.video},
        fam.placeholders,
        fam.kwargs,
        states=name in grid.STATE_FAMILIES,
    )


def _qwen3(name: str) -> MediaCase:
    fam = qwen3.Qwen3Family(name)
    media = {"image": fam.image, "video": fam.video}
    return MediaCase(
        name,
        fam.model,
        media,
        fam.placeholders,
        fam.kwargs,
        qwen3.HYBRID.count(name) > 0,
        fam.first,
        longer=True,
        repeat=True,
    )


def _packed(name: str) -> MediaCase:
    fam = packed.PackedFamily(name)
    return MediaCase(name, fam.model, {"image": fam.image}, fam.placeholders, _ignore_ids(fam.kwargs), states=True)


def _inkling() -> MediaCase:
    return MediaCase(
        "inkling",
        inkling.tiny_inkling(),
        {"image": inkling.image, "audio": inkling.clip},
        inkling.placeholders,
        _ignore_ids(inkling.media_kwargs),
        states=True,
    )


def _nemotron_h_omni() -> MediaCase:
    n = nemotron_h_omni
    media = {"image": n.image, "audio": n.clip}
    model = n.tiny_nemotron_h_omni()
    return MediaCase("nemotron_h_omni", model, media, n.placeholders, _ignore_ids(n.media_kwargs), states=True)


def _single(name: str, module: Any, model: Callable[[], Any], kind: str, framing: int) -> MediaCase:
    """A family of one kind of medium built by `module.Image` or `module.Clip`, its kwargs from the media alone.

    Its changed-medium case runs seed 13's medium, then seed 1's again.
    """
    build = module.Image if kind == "image" else module.Clip
    return MediaCase(
        name,
        model(),
        {kind: build},
        module.placeholders,
        _ignore_ids(module.media_kwargs),
        framing=lambda _medium: framing,
        changes=(13,),
        repeat=True,
    )


#: Families of one kind of medium: (module, model, kind, framing ids before a medium's first placeholder).
SINGLE = {
    "emu3": (emu3, emu3.tiny_emu3, "image", 2),
    "ovis2": (ovis2, ovis2.tiny_ovis2, "image", 0),
    "moss": (moss, moss.tiny_moss, "audio", 1),
    "vibevoice": (vibevoice, vibevoice.tiny_vibevoice_asr, "audio", 1),
}


def _rows() -> dict[str, Callable[[], MediaCase]]:
    rows: dict[str, Callable[[], MediaCase]] = {}
    rows.update({name: partial(_grid, name) for name in grid.FAMILIES})
    rows.update({name: partial(_qwen3, name) for name in qwen3.FAMILIES})
    rows.update({name: partial(_packed, name) for name in packed.FAMILIES})
    rows["inkling"] = _inkling
    rows["nemotron_h_omni"] = _nemotron_h_omni
    rows.update({name: partial(_single, name, *row) for name, row in SINGLE.items()})
    return rows


#: Family name -> its case, built on demand (models are built on first use).
CASES: dict[str, Callable[[], MediaCase]] = _rows()
