"""The encoder-decoder tests' shared reference: requests keyed by their encoder input, and the reuse they may get.

Seq2seq models (BART, T5, Florence-2, ...) and Whisper key a decoder prefix under its encoder input (the
source ids, the clip): a request reuses the longest decoder prefix stored under the same input, and a
request may continue the previous answer. Knows nothing of a model: callers run the requests.

Example:
    >>> from hf_prefix_cache.testing.encoder_decoder import decoder_reuse, next_request
    >>> next_request(None, 3, [7, 8], False, [0])
    (3, [0, 7, 8])
    >>> decoder_reuse([(3, [0, 7, 9, 4])], 3, [0, 7, 8])
    2
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from hf_prefix_cache.testing.reference import longest_prefix


def next_request(
    previous: tuple[Hashable, list[int]] | None,
    source: Hashable,
    tail: Sequence[int],
    continues: bool,
    start: Sequence[int],
) -> tuple[Hashable, list[int]]:
    """A drawn request's (encoder input, decoder prompt): the previous answer plus `tail` when it `continues`
    (and there is one), else `start` plus `tail` under `source`."""
    if continues and previous is not None:
        return previous[0], previous[1] + list(tail)
    return source, [*start, *tail]


def decoder_reuse(stored: Sequence[tuple[Hashable, list[int]]], source: Hashable, prompt: Sequence[int]) -> int:
    """The decoder tokens a request may reuse: its longest common prefix with a sequence stored under the
    same encoder input, capped at all but the prompt's last token."""
    longest = longest_prefix([seq for other, seq in stored if other == source], prompt)
    return min(longest, len(prompt) - 1)
