"""Sizes past what float32 holds exactly: indices, counts and byte totals stay exact at real model sizes."""

from __future__ import annotations

import pytest
import torch

from hf_prefix_cache.keys.weights import sample_indices, weights_fingerprint


@pytest.mark.parametrize(
    "numel", [2**24 - 1, 2**24, 2**24 + 1, 2**24 + 3, 28_311_552, 32_000 * 4_096, 2**31 + 5, 2**40 + 7]
)
def test_sample_indices_stay_inside_any_parameter(numel: int) -> None:
    """Sample indices are exact integers: the first is 0, the last is numel - 1, all strictly increasing."""
    idx = sample_indices(numel, 4096)
    assert idx.dtype == torch.int64
    assert idx[0].item() == 0 and idx[-1].item() == numel - 1
    assert bool((idx[1:] > idx[:-1]).all())


def test_weights_fingerprint_of_a_parameter_past_2_pow_24() -> None:
    """SmolLM2's 28,311,552-element embedding (and any 7B one) is fingerprinted, and its last element counts."""
    for numel in (2**24 + 1, 28_311_552):
        module = torch.nn.Module()
        module.weight = torch.nn.Parameter(torch.zeros(numel), requires_grad=False)
        before = weights_fingerprint(module)
        module.weight.data[-1] = 1.0
        assert weights_fingerprint(module) != before


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("9007199254740993", 2**53 + 1),
        ("0.1kB", 100),
        ("1.1GB", 1_100_000_000),
        ("70GiB", 70 * 2**30),
        ("3.3TB", 3_300_000_000_000),
        ("1.5 GiB", 3 * 2**29),
    ],
)
def test_byte_sizes_parse_exactly_past_float_precision(text: str, nbytes: int) -> None:
    """Byte sizes written as strings are parsed without float rounding, at any size."""
    from hf_prefix_cache.storage.budgets import parse_nbytes

    assert parse_nbytes(text) == nbytes


def test_media_symbols_stay_distinct_for_long_items_and_128_bit_digests() -> None:
    """A 100k-placeholder item with the largest digest gives distinct negative symbols that no other item shares."""
    from hf_prefix_cache.multimodal.media import MediaItem

    top = MediaItem("video", 2**128 - 1, 0, 100_000).symbols()
    other = MediaItem("video", 2**128 - 2, 0, 100_000).symbols()
    assert len(set(top)) == 100_000 and all(s < 0 for s in top)
    assert not set(top) & set(other)
    assert not set(top) & set(MediaItem("image", 2**128 - 1, 0, 100_000).symbols())
