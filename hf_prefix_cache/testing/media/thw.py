"""The families whose images and videos are flattened patch rows keyed by a ``(t, h, w)`` grid: one base for them.

A medium is its kind, seed and grid (`Medium`); a prompt's media kwargs are each kind's rows,
concatenated in prompt order, and their grids (`grid_kwargs`). `ThwFamily` holds what such a
family's builder shares: media of pool seeds (seeds 1 and 13 give one grid, other content), the
token types the processor marks, and the family's sweep case and suite row. A family sets its
name, model, grids and placeholders, and overrides what it does otherwise.

Example:
    >>> medium = Medium("image", 1, (1, 2, 4))
    >>> sorted(grid_kwargs([medium], lambda m: patches(m.seed, m.grid)))
    ['image_grid_thw', 'pixel_values']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.media.arrays import seeded_rand
from hf_prefix_cache.testing.media.cases import MediaCase
from hf_prefix_cache.testing.tiny_build import one_model
from hf_prefix_cache.testing.tiny_qwen_media import image_tokens, qwen3_video_tokens
from hf_prefix_cache.testing.tiny_vlm_parts import IMAGE_ID, VIDEO_ID

#: Per kind of medium: the kwarg of its rows and the kwarg of its grids.
_GRID_KWARGS = (("image", "pixel_values", "image_grid_thw"), ("video", "pixel_values_videos", "video_grid_thw"))


@dataclass(frozen=True)
class Medium:
    """One image or video: its kind, seed and ``(t, h, w)`` grid."""

    kind: str
    seed: int
    grid: tuple[int, int, int]


def patches(seed: int, grid: tuple[int, int, int]) -> torch.Tensor:
    """``t*h*w`` flattened patch rows (``3*2*2`` values each) of an image or video of `grid`."""
    t, h, w = grid
    return seeded_rand(t * h * w, 3 * 2 * 2, seed=seed)


def grid_kwargs(media: Sequence[Any], rows: Callable[[Any], torch.Tensor]) -> dict[str, Any]:
    """Each kind's `rows` of `media` (in prompt order) concatenated, and their grids; kinds absent are left out."""
    out: dict[str, Any] = {}
    for kind, data, grid in _GRID_KWARGS:
        mine = [m for m in media if m.kind == kind]
        if mine:
            out[data] = torch.cat([rows(m) for m in mine])
            out[grid] = torch.tensor([list(m.grid) for m in mine])
    return out


class ThwFamily:
    """A family of ``(t, h, w)`` media: its pool, token types, media kwargs, sweep case and suite row.

    Subclasses set `name`, `build` (or `model` in their ``__init__``), the pools `grids` /
    `video_grids` and `placeholders`; `video_grids` empty means the family takes images only.
    """

    name: str
    #: The family's tiny model builder: the family holds its one model per session.
    build: Callable[[], Any]
    model: Any
    #: The grid of an image / video per pool seed (``seed % 3``).
    grids: Sequence[tuple[int, int, int]] = ()
    video_grids: Sequence[tuple[int, int, int]] = ()
    #: Placeholder ids the processor's `mm_token_type_ids` marks 1 (image) and 2 (video), those of
    #: `tiny_vlm_parts` unless the family says otherwise; None: no such kwarg (no such medium).
    image_id: int | None = IMAGE_ID
    video_id: int | None = VIDEO_ID
    #: Its suite row's flags (`MediaCase`).
    states = False
    longer = True
    repeat = True

    def __init__(self) -> None:
        self.model = one_model(self.build)

    def image(self, seed: int) -> Medium:
        return Medium("image", seed, self.grids[seed % 3])

    def video(self, seed: int) -> Medium:
        return Medium("video", seed, self.video_grids[seed % 3])

    def placeholders(self, medium: Medium) -> torch.Tensor:
        raise NotImplementedError

    def first(self, medium: Medium) -> int:
        """Offset of the medium's first placeholder in its tokens (after one begin id)."""
        return 1

    def rows(self, medium: Medium) -> torch.Tensor:
        return patches(medium.seed, medium.grid)

    def token_kwargs(self, ids: torch.Tensor) -> dict[str, Any]:
        """The kwargs the processor derives from the prompt's ids: its token types."""
        if self.image_id is None:
            return {}
        types = (ids == self.image_id).int()
        if self.video_id is not None:
            types = types + 2 * (ids == self.video_id).int()
        return {"mm_token_type_ids": types}

    def kwargs(self, ids: torch.Tensor, media: list[Medium]) -> dict[str, Any]:
        """What the processor hands `generate` for `ids` holding `media` in prompt order."""
        return {**self.token_kwargs(ids), **grid_kwargs(media, self.rows)}

    def media(self) -> dict[str, Callable[[int], Medium]]:
        """A builder per kind of medium the family takes."""
        return {"image": self.image, "video": self.video} if self.video_grids else {"image": self.image}

    def sweep(self) -> registry.SweepCase:
        """The support matrix's scenario: A an image; C an image, text, then a video (an image without videos)."""
        media = registry.mixed(self.image, self.image, self.video if self.video_grids else self.image)
        return registry.mixed_sweep(self.model, self.placeholders, media, self.kwargs, first=self.first(media["a"][0]))

    def suite(self) -> MediaCase:
        """The family suite's row."""
        return MediaCase(
            self.name,
            self.model,
            self.media(),
            self.placeholders,
            self.kwargs,
            self.states,
            self.first,
            longer=self.longer,
            repeat=self.repeat,
        )


class Qwen3StyleFamily(ThwFamily):
    """A family that writes its media as Qwen3-VL does (`tiny_qwen_media`): an image framed by vision start and end,
    a video per frame its timestamp text, vision start, ``h*w/4`` placeholders, vision end."""

    def placeholders(self, medium: Medium) -> torch.Tensor:
        return image_tokens(medium.grid) if medium.kind == "image" else qwen3_video_tokens(medium.grid)

    def first(self, medium: Medium) -> int:
        """Offset of the medium's first placeholder in its tokens (past a video's first timestamp)."""
        return int((self.placeholders(medium)[0] == (IMAGE_ID if medium.kind == "image" else VIDEO_ID)).nonzero()[0])
