"""Media keys: content hashes of media items and the symbols their placeholders become.

A media item (one image, one video, one audio clip) is identified by a 128-bit xxhash
(xxh3_128) of exactly what the model consumes: for each part a type tag, the dtype, the
shape and the raw bytes, streamed into one hasher. Nothing is ever pickled: types we cannot
serialise raise `UnhashableMediaError`.

In a prompt, an item occupies a span of placeholder tokens. For the radix tree each of
those positions becomes a negative int encoding (item hash, index within the item, kind),
which no token id can equal; so a stored prefix matches only if its tokens and every media
item overlapping it match. Cut points never fall inside a span (`clamp_below_spans`). An item
keyed with padding its model reads (`MediaItem.unpadded`) encodes its content's hash above
that hash, so a stored item of the same content, padded otherwise, can be told from another
item (`symbol_content`): reuse stops at it either way, but that loss is counted.

Knows nothing about models, the store or transformers: `multimodal/` says which tensors
of which model make up an item.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash
from PIL import Image

from hf_prefix_cache.errors import InconsistentStateError, UnhashableMediaError

#: Media kinds and the code each one has inside a symbol.
KIND_CODES = {"image": 1, "video": 2, "audio": 3}
_INDEX_BITS = 32
_KIND_BITS = 8
_DIGEST_BITS = 128
_KIND_NAMES = {code: kind for kind, code in KIND_CODES.items()}


def hash_media(*parts: Any) -> int:
    """128-bit content hash of one media item made of `parts` (tensors, arrays, PIL images).

    Each part contributes a type tag, its dtype (or mode), its shape and its raw bytes, so
    equal pixels with another dtype or shape hash differently.

    Returns:
        The digest as a non-negative int below 2**128.

    Raises:
        UnhashableMediaError: for a part that is not a torch tensor, numpy array or PIL image.
    """
    hasher = xxhash.xxh3_128()
    for part in parts:
        _update(hasher, part)
    return hasher.intdigest()


def _update(hasher: Any, part: Any) -> None:
    if isinstance(part, torch.Tensor):
        t = part.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        hasher.update(b"torch|%s|%s|" % (str(t.dtype).encode(), repr(tuple(t.shape)).encode()))
        # Raw bytes without a copy: reinterpret the storage as bytes (works for bfloat16 too).
        hasher.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(part, np.ndarray):
        if part.dtype.hasobject:
            raise UnhashableMediaError("numpy arrays of Python objects cannot be hashed; pass numeric arrays")
        a = np.ascontiguousarray(part)
        hasher.update(b"numpy|%s|%s|" % (a.dtype.str.encode(), repr(a.shape).encode()))
        hasher.update(a.reshape(-1).view(np.uint8))
    elif isinstance(part, Image.Image):
        hasher.update(b"pil|%s|%s|" % (part.mode.encode(), repr(part.size).encode()))
        palette = part.getpalette() if part.mode == "P" else None
        if palette is not None:
            hasher.update(bytes(palette))
        hasher.update(part.tobytes())
    else:
        raise UnhashableMediaError(
            f"cannot hash media of type {type(part).__name__}; pass torch tensors, numpy arrays or PIL images"
        )


@dataclass(frozen=True, slots=True)
class MediaItem:
    """One media item in a prompt: its placeholder span `[start, end)` and its content hash."""

    kind: str
    digest: int
    start: int
    end: int
    #: For an item keyed with padding its model reads (Phi-4 audio): the digest of its content alone, as it
    #: keys without padding (its symbols hold it above `digest`, see `symbol_content`).
    unpadded: int | None = None

    @property
    def content(self) -> int:
        """The digest of what the item holds, whatever padding it is keyed with."""
        return self.digest if self.unpadded is None else self.unpadded

    def symbols(self) -> list[int]:
        """The tree symbols of the item's placeholder positions (negative ints, never token ids)."""
        if self.end - self.start > 1 << _INDEX_BITS:
            raise InconsistentStateError(f"{self.end - self.start} placeholders do not fit a symbol")
        key = self.digest if self.unpadded is None else (self.unpadded << _DIGEST_BITS) | self.digest
        base = ((key << _INDEX_BITS) << _KIND_BITS) | KIND_CODES[self.kind]
        return [-1 - (base | (i << _KIND_BITS)) for i in range(self.end - self.start)]


@dataclass(frozen=True, slots=True)
class MediaLayout:
    """The media items of one prompt, in prompt order."""

    items: tuple[MediaItem, ...]

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        return tuple((item.start, item.end) for item in self.items)

    def symbols(self, tokens: Sequence[int]) -> list[Hashable]:
        """`tokens` with every placeholder position replaced by its media symbol."""
        out: list[Hashable] = list(tokens)
        for item in self.items:
            if item.end > len(out):
                raise InconsistentStateError(f"span [{item.start}, {item.end}) beyond {len(out)} tokens")
            out[item.start : item.end] = item.symbols()
        return out

    def num_cached(self, kind: str, cached_len: int) -> int:
        """How many items of `kind` lie wholly inside the first `cached_len` positions."""
        return sum(1 for item in self.items if item.kind == kind and item.end <= cached_len)


def symbol_kind(symbol: Hashable) -> str:
    """``"text"`` for a token id, else the media kind encoded in a placeholder's symbol."""
    if not isinstance(symbol, int) or symbol >= 0:
        return "text"
    code = (-1 - symbol) & ((1 << _KIND_BITS) - 1)
    return _KIND_NAMES.get(code, "text")


def symbol_content(symbol: Hashable) -> tuple[str, int] | None:
    """The kind and content digest (`MediaItem.content`) of a media item's symbol; None for a token id.

    A stored item and a prompt's item of equal content but other padding have other symbols and one content.
    """
    if not isinstance(symbol, int) or symbol >= 0:
        return None
    code = -1 - symbol
    key = code >> (_INDEX_BITS + _KIND_BITS)
    content = key >> _DIGEST_BITS or key  # a padded item's content sits above its digest
    return _KIND_NAMES.get(code & ((1 << _KIND_BITS) - 1), "text"), content


def item_symbols(first: int, length: int) -> list[int]:
    """The symbols of the `length` placeholders of the item whose first symbol is `first` (`MediaItem.symbols`)."""
    return [first - (i << _KIND_BITS) for i in range(length)]


def find_runs(tokens: Sequence[int], token_id: int) -> list[tuple[int, int]]:
    """Maximal runs `[start, end)` of `token_id` in `tokens`."""
    runs: list[tuple[int, int]] = []
    start = None
    for i, t in enumerate(tokens):
        if t == token_id:
            if start is None:
                start = i
        elif start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(tokens)))
    return runs


def assign_spans(runs: Sequence[tuple[int, int]], lengths: Sequence[int]) -> list[tuple[int, int]] | None:
    """Tie items of placeholder `lengths` (in order) to the placeholder `runs`.

    A run may hold several adjacent items (e.g. two images with nothing between them); an item
    never spans two runs.

    Returns:
        One span per item, or None when the runs cannot be cut into items of those lengths
        (the prompt does not match its media; the model itself will complain).
    """
    spans: list[tuple[int, int]] = []
    k = 0
    for start, end in runs:
        pos = start
        while pos < end:
            if k == len(lengths) or lengths[k] <= 0 or pos + lengths[k] > end:
                return None
            spans.append((pos, pos + lengths[k]))
            pos += lengths[k]
            k += 1
    return spans if k == len(lengths) else None


def clamp_below_spans(length: int, spans: Sequence[tuple[int, int]]) -> int:
    """The largest cut point `<= length` that does not fall strictly inside any span."""
    for start, end in spans:
        if start < length < end:
            length = start
    return length
