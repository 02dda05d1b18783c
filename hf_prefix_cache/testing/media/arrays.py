"""The media fixtures' arrays: content drawn from a seed, and a prompt's clips padded to one length with their mask.

Example:
    >>> values, mask = padded([seeded_rand(3, seed=1), seeded_rand(5, seed=2)], 6)
    >>> mask.sum(dim=1).tolist()
    [3, 5]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def seeded_rand(*shape: int, seed: int) -> torch.Tensor:
    """``torch.rand(*shape)`` drawn from a generator seeded with `seed` (the media fixtures' content)."""
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed))


def padded(
    rows: Sequence[torch.Tensor], length: int, mask_dtype: torch.dtype = torch.long
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` (each ``[valid, ...]``) stacked and zero-padded along their first axis to `length`, and the mask of
    each row's valid part."""
    values = torch.zeros(len(rows), length, *rows[0].shape[1:], dtype=rows[0].dtype)
    mask = torch.zeros(len(rows), length, dtype=mask_dtype)
    for i, row in enumerate(rows):
        values[i, : row.shape[0]] = row
        mask[i, : row.shape[0]] = 1
    return values, mask


def padded_images(images: Sequence[torch.Tensor]) -> torch.Tensor:
    """`images` (each ``[channels, height, width]``) stacked, zero-padded at the bottom and right to the largest."""
    height, width = max(i.shape[1] for i in images), max(i.shape[2] for i in images)
    out = torch.zeros(len(images), images[0].shape[0], height, width, dtype=images[0].dtype)
    for k, image in enumerate(images):
        out[k, :, : image.shape[1], : image.shape[2]] = image
    return out
