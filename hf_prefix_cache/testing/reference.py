"""Reference matchers the property tests check the store against: plain loops over what was stored, no torch.

The store must reuse exactly what these predict (or, under memory pressure, no more).

Example:
    >>> from hf_prefix_cache.testing.reference import longest_prefix, span_cut
    >>> longest_prefix([[1, 2, 3], [1, 5]], [1, 2, 4])
    2
    >>> span_cut(6, prompt_len=8, spans=[(4, 7)])
    4
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence


def longest_prefix(stored: Iterable[Sequence[Hashable]], query: Sequence[Hashable]) -> int:
    """The length of the longest common prefix of `query` with any stored sequence."""
    best = 0
    for seq in stored:
        n = 0
        while n < min(len(seq), len(query)) and seq[n] == query[n]:
            n += 1
        best = max(best, n)
    return best


def span_cut(matched_len: int, prompt_len: int, spans: Iterable[tuple[int, int]]) -> int:
    """The reuse a match allows: capped at all but the prompt's last token (fed for its logits), and moved
    back to the start of a media span [start, end) it would cut."""
    cut = min(matched_len, prompt_len - 1)
    for start, end in spans:
        if start < cut < end:
            cut = start
    return cut
