"""Media content hashes, placeholder spans and the symbols the radix tree sees."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from hf_prefix_cache import UnhashableMediaError
from hf_prefix_cache.multimodal.media import (
    MediaItem,
    MediaLayout,
    assign_spans,
    clamp_below_spans,
    find_runs,
    hash_media,
)
from hf_prefix_cache.tree.radix import RadixTree


def _pixels(seed: int = 0) -> torch.Tensor:
    return torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(seed))


def test_same_pixels_hash_the_same() -> None:
    """Two tensors with equal contents (one a non-contiguous view) hash to the same value."""
    a = _pixels()
    b = a.clone().transpose(1, 2).contiguous().transpose(1, 2)
    assert not b.is_contiguous()
    assert hash_media(a) == hash_media(b) == hash_media(a.clone())


def test_one_changed_pixel_changes_the_hash() -> None:
    """Changing a single value gives another hash."""
    a = _pixels()
    b = a.clone()
    b[2, 7, 7] += 1e-3
    assert hash_media(a) != hash_media(b)


@pytest.mark.parametrize("other", [lambda t: t.to(torch.float64), lambda t: t.reshape(3, 4, 16), lambda t: t[:, :4]])
def test_dtype_and_shape_are_part_of_the_hash(other: object) -> None:
    """The same values with another dtype or shape (or a cut) hash differently."""
    a = _pixels()
    assert hash_media(a) != hash_media(other(a))  # type: ignore[operator]


def test_bfloat16_tensors_hash_by_their_bytes() -> None:
    """A dtype numpy lacks still hashes by its raw bytes."""
    a = _pixels().to(torch.bfloat16)
    b = a.clone()
    b[0, 0, 0] = 7
    assert hash_media(a) == hash_media(a.clone()) != hash_media(b)


def test_numpy_arrays_and_tensors_are_tagged_apart() -> None:
    """A numpy array hashes by content and never collides with the tensor of the same bytes."""
    a = _pixels().numpy()
    assert hash_media(a) == hash_media(a.copy()) == hash_media(np.asfortranarray(a))
    assert hash_media(a) != hash_media(torch.from_numpy(a))
    b = a.copy()
    b[1, 1, 1] = 0.5
    assert hash_media(a) != hash_media(b)


def test_pil_images_hash_by_mode_size_and_pixels() -> None:
    """PIL images hash by pixels, mode and size."""
    arr = (np.arange(8 * 6 * 3) % 251).astype(np.uint8).reshape(8, 6, 3)
    img = Image.fromarray(arr)
    assert hash_media(img) == hash_media(Image.fromarray(arr.copy()))
    changed = arr.copy()
    changed[0, 0, 0] ^= 1
    assert hash_media(img) != hash_media(Image.fromarray(changed))
    assert hash_media(img) != hash_media(img.convert("RGBA"))
    assert hash_media(img) != hash_media(img.transpose(Image.Transpose.TRANSPOSE))


def test_parts_are_hashed_in_order() -> None:
    """An item made of several parts depends on each part and on their order."""
    a, grid = _pixels(), torch.tensor([1, 4, 6])
    assert hash_media(a, grid) != hash_media(a)
    assert hash_media(a, grid) != hash_media(grid, a)
    assert hash_media(a, grid) == hash_media(a.clone(), grid.clone())


@pytest.mark.parametrize("bad", [[1.0, 2.0], b"raw", "image.png", np.array([object()]), None])
def test_unhashable_media_raises(bad: object) -> None:
    """Anything but tensors, numeric arrays and PIL images raises UnhashableMediaError."""
    with pytest.raises(UnhashableMediaError):
        hash_media(bad)


def test_runs_and_spans() -> None:
    """Placeholder runs are found, and adjacent items in one run are cut by their lengths."""
    tokens = [5, 9, 9, 9, 9, 6, 9, 9, 7]
    runs = find_runs(tokens, 9)
    assert runs == [(1, 5), (6, 8)]
    assert assign_spans(runs, [2, 2, 2]) == [(1, 3), (3, 5), (6, 8)]
    assert assign_spans(runs, [4, 2]) == [(1, 5), (6, 8)]
    assert assign_spans(runs, [3, 3]) is None  # an item would span two runs
    assert assign_spans(runs, [4]) is None  # a run left over
    assert assign_spans(runs, [4, 2, 1]) is None  # an item left over
    assert find_runs([9, 9], 9) == [(0, 2)]


def test_clamp_moves_cuts_out_of_spans() -> None:
    """A cut inside a span moves to its start; cuts on boundaries stay."""
    spans = [(2, 6), (6, 10), (12, 14)]
    assert [clamp_below_spans(n, spans) for n in (0, 2, 3, 6, 7, 10, 11, 13, 14, 20)] == [
        0,
        2,
        2,
        6,
        6,
        10,
        11,
        12,
        14,
        20,
    ]


def test_symbols_never_equal_token_ids_and_depend_on_content() -> None:
    """Placeholder positions become distinct negative symbols per item content and index."""
    tokens = [5, 9, 9, 9, 6]
    a = MediaLayout((MediaItem("image", hash_media(_pixels(0)), 1, 4),))
    b = MediaLayout((MediaItem("image", hash_media(_pixels(1)), 1, 4),))
    sa, sb = a.symbols(tokens), b.symbols(tokens)
    assert sa[0] == 5 and sa[4] == 6
    assert all(isinstance(s, int) and s < 0 for s in sa[1:4])
    assert len(set(sa[1:4])) == 3
    assert sa[1:4] != sb[1:4]
    as_video = MediaLayout((MediaItem("video", a.items[0].digest, 1, 4),))
    assert as_video.symbols(tokens)[1:4] != sa[1:4]
    assert a.symbols(tokens) == MediaLayout((MediaItem("image", hash_media(_pixels(0)), 1, 4),)).symbols(tokens)


def test_tree_matches_up_to_the_first_changed_item() -> None:
    """With identical token ids, a changed second image stops the match at its start."""

    class Blob(bytes):
        nbytes = property(len)

        def split(self, k: int) -> tuple[Blob, Blob]:
            return Blob(self[:k]), Blob(self[k:])

    tokens = [5, 9, 9, 6, 9, 9, 7]
    img = [hash_media(_pixels(i)) for i in range(3)]
    first = MediaLayout((MediaItem("image", img[0], 1, 3), MediaItem("image", img[1], 4, 6)))
    second = MediaLayout((MediaItem("image", img[0], 1, 3), MediaItem("image", img[2], 4, 6)))
    tree: RadixTree[Blob] = RadixTree()
    tree.insert("ns", first.symbols(tokens), lambda a, b: Blob(b"x" * (b - a)))
    assert tree.match("ns", first.symbols(tokens)).matched_len == 7
    assert tree.match("ns", second.symbols(tokens)).matched_len == 4
    assert tree.match("ns", tokens).matched_len == 1
    assert first.num_cached("image", 4) == 1 and first.num_cached("image", 7) == 2 and first.num_cached("video", 7) == 0
