"""String stops: a row ends at exactly the token where `generate(..., stop_strings=, tokenizer=)` ends it.

`StopStrings` wraps transformers' own `StopStringCriteria`, so a row matches with generate's semantics
on every transformers version the library supports, not a reimplementation of them: a stop string
matches when it is found in the text of the row's last tokens and overlaps its LAST token, whether it
lies inside one token (``"op"`` in ``"stopping"``), straddles several (``["st", "op"]``), or the last token
overhangs it (``["st", "opera"]``). A stop string that ended before the last token never matches later.
The text is each token's own string from the tokenizer's vocabulary (byte-level pieces for byte-level
tokenizers), not a decode of the whole answer.

The prompt takes part, as in `generate`, which checks prompt and answer together: a stop string that
begins in the prompt's last tokens and ends in a generated token ends the row at that token. One that
lies wholly in the prompt never does (it cannot overlap a generated token).

Building one costs what `generate` pays for its criteria (about 0.1 s to 0.3 s on a 49k-token
vocabulary, the vocabulary's embedding being cached by transformers); `Row` builds it once, in the
caller's thread (`Scheduler.submit`). Each check afterwards looks only at the last
`window` ids (about 0.2 ms).

Example:
    >>> from hf_prefix_cache.api.models import load_smollm2
    >>> _, tokenizer = load_smollm2()  # doctest: +SKIP
    >>> stops = StopStrings(tokenizer, ("stop",))  # doctest: +SKIP
    >>> stops.hit(tokenizer("we must st")["input_ids"], tokenizer("opping now")["input_ids"][:1])  # doctest: +SKIP
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.generation.stopping_criteria import StopStringCriteria


class StopStrings:
    """A request's stop strings, matched as `generate`'s `StopStringCriteria` matches them.

    Args:
        tokenizer: the model's tokenizer (what `generate` takes as ``tokenizer=``).
        stop_strings: the strings that end the answer.

    Raises:
        ValueError: no stop string given, or one that no token of the vocabulary can end (as `generate` raises).
    """

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str]) -> None:
        if not stop_strings:
            raise ValueError("StopStrings needs at least one stop string")
        self.stop_strings = tuple(stop_strings)
        self._criteria = StopStringCriteria(tokenizer, list(self.stop_strings))
        #: ids the criteria looks at: one per character of the longest stop string (transformers' own bound).
        self.window = int(self._criteria.maximum_token_len)

    def hit(self, prompt: Sequence[int], tokens: Sequence[int]) -> bool:
        """Whether a stop string ends in the last of `tokens` (the prompt's tail counting, as in `generate`)."""
        if not tokens:
            return False
        tail = list(tokens[-self.window :])
        if len(tail) < self.window:
            tail = [*prompt[len(tail) - self.window :], *tail]
        ids = torch.tensor([tail], dtype=torch.long)
        return bool(self._criteria(ids, None)[0].item())
