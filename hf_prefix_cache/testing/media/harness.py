"""The media tests' shared harness: a served store, the cold-versus-cached check, a random chat's loop.

Every media family's tests drive its tiny model the same way: a store attached for one test and
checked when it ends (`served`), each request run cold and through the store with the media and
framing ids suppressed from answers (`check`), and random conversations replayed request by request
against a reference of the keying rules (`converse`). The family suite (`tests/media/test_media_families.py`)
and the per-family files use these; the families' builders live beside this module.

Knows nothing of a family's layout: callers pass the kwargs a request's media need.

Example:
    >>> from hf_prefix_cache.testing.media.harness import served
    >>> from hf_prefix_cache.testing.tiny_models import build
    >>> with served(build("llama")) as store:
    ...     pass  # run requests through `store`; integrity and no fallbacks are checked on exit
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.compare import assert_same_as_cold, generate

#: New tokens per request in the media tests.
NEW = 4
#: Media placeholder and framing ids of the tiny media models: suppressed from answers, so a later
#: turn built from an answer stays a valid prompt.
SPECIAL_IDS = list(range(100, 128))


@contextmanager
def served(model: Any, *, clean: bool = True, **options: Any) -> Iterator[PrefixCache]:
    """A store on `model` for one test; detached on exit.

    Args:
        model: The tiny model to attach to.
        clean: When the body ends without error, check the store's integrity and that nothing fell back.
        **options: `PrefixCache` options (`max_bytes`, `disk_dir`, `snapshot_interval`, ...).
    """
    store = PrefixCache(model, **options)
    try:
        yield store
        if clean:
            store.check_integrity()
            assert not store.stats().fallbacks, store.stats().fallbacks
    finally:
        store.detach()


def check(model: Any, ids: torch.Tensor, store: PrefixCache, media_kwargs: dict[str, Any], **extra: Any) -> Any:
    """Run `ids` cold and through `store` (`assert_same_as_cold`, `past_key_values`); return the cached run.

    Answers never contain media or framing ids (`SPECIAL_IDS`); `extra` overrides any kwarg.
    """
    kwargs = {**media_kwargs, "suppress_tokens": SPECIAL_IDS, **extra}
    return assert_same_as_cold(model, ids, store, NEW, cache_argument="past_key_values", **kwargs)


def same_tokens_twice(model: Any, ids: torch.Tensor, store: PrefixCache, **kwargs: Any) -> None:
    """Run `ids` cold and through `store` twice (`suppress_tokens` included); assert equal tokens each time.

    For requests the store must run cold: callers then assert the named fallbacks and no hits.
    """
    kwargs = {"suppress_tokens": SPECIAL_IDS, **kwargs}
    for _ in range(2):
        cold = generate(model, ids, NEW, **kwargs)
        warm = generate(model, ids, NEW, past_key_values=store, **kwargs)
        assert torch.equal(cold.sequences, warm.sequences)


class ChatPrompt(Protocol):
    """A prompt of a random conversation: text and media pieces, continued by a previous answer."""

    def add_text(self, tokens: list[int]) -> None: ...

    def add_medium(self, index: int) -> None: ...

    def continued(self, answer: list[int]) -> ChatPrompt: ...


def converse(
    conversation: Iterable[tuple[Sequence[Any], bool]],
    start: Callable[[], ChatPrompt],
    serve: Callable[[Any], list[int]],
) -> None:
    """Replay a drawn conversation: each request's pieces added to a new or a continued prompt, then served.

    Args:
        conversation: (new pieces, continues the previous answer) per request; a piece is a list of
            text ids or the index of a medium in the pool.
        start: A fresh prompt.
        serve: Runs one prompt (cold and cached, checking its reuse) and returns its answer's ids.
    """
    previous: tuple[Any, list[int]] | None = None
    for new_pieces, continues in conversation:
        prompt = previous[0].continued(previous[1]) if continues and previous is not None else start()
        for piece in new_pieces:
            prompt.add_medium(piece) if isinstance(piece, int) else prompt.add_text(piece)
        previous = (prompt, serve(prompt))


def answer_of(out: Any, ids: torch.Tensor) -> list[int]:
    """The generated ids of a `generate` output whose prompt was `ids`."""
    return list(out.sequences[0, ids.shape[1] :].tolist())


def stored_symbols(symbols: list[Hashable], answer: list[int]) -> list[Hashable]:
    """What a served request leaves in the store: its prompt's symbols and its answer but the last token."""
    return symbols + answer[:-1]
