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

Building the criteria costs what `generate` pays for its own (0.1 s to 0.4 s on a 49k-token
vocabulary), so the criteria are kept per tokenizer and stop strings (the last `CACHED` sets of each
tokenizer, keyed by its size too, so a token added since misses): requests repeating a stop set, as a
server's do, pay it once. `Row` builds its `StopStrings` in the caller's thread (`Scheduler.submit`).
Each check looks only at the last `window` ids (about 0.2 ms).

Example:
    >>> from hf_prefix_cache.api.models import load_smollm2
    >>> _, tokenizer = load_smollm2()  # doctest: +SKIP
    >>> stops = StopStrings(tokenizer, ("stop",))  # doctest: +SKIP
    >>> stops.hit(tokenizer("we must st")["input_ids"], tokenizer("opping now")["input_ids"][:1])  # doctest: +SKIP
    True
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from transformers.generation.stopping_criteria import StopStringCriteria

#: Stop sets kept per tokenizer (least recently used dropped first).
CACHED = 64

_Sets = collections.OrderedDict[tuple[int, tuple[str, ...]], StopStringCriteria]
_criteria: weakref.WeakKeyDictionary[Any, _Sets] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


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
        self._criteria = _criteria_for(tokenizer, self.stop_strings)
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


def _criteria_for(tokenizer: Any, stop_strings: tuple[str, ...]) -> StopStringCriteria:
    """transformers' criteria for these stop strings, kept per tokenizer (built anew for one that takes no weakref)."""
    try:
        key = (len(tokenizer), stop_strings)
        with _lock:
            sets = _criteria.setdefault(tokenizer, collections.OrderedDict())
            if key in sets:
                sets.move_to_end(key)
                return sets[key]
    except TypeError:  # a tokenizer that takes no weak reference or no hash: nothing kept
        return StopStringCriteria(tokenizer, list(stop_strings))
    criteria = StopStringCriteria(tokenizer, list(stop_strings))  # outside the lock: it takes a while
    with _lock:
        sets[key] = criteria
        while len(sets) > CACHED:
            sets.popitem(last=False)
    return criteria
