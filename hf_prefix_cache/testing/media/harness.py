"""The media tests' shared harness: a served store, the cold-versus-cached check, a random chat's loop.

Every media family's tests drive its tiny model the same way: a store attached for one test and
checked when it ends (`served`, re-exported from `testing.compare`), each request run cold and through the store with the media and
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

import tempfile
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.compare import assert_same_as_cold, generate, served
from hf_prefix_cache.testing.reference import longest_prefix, span_cut

__all__ = [
    "NEW",
    "SPECIAL_IDS",
    "ChatPrompt",
    "check",
    "conversation_store",
    "converse",
    "converse_checked",
    "expected_reuse",
    "same_tokens_twice",
    "served",
]

#: New tokens per request in the media tests.
NEW = 4
#: Media placeholder and framing ids of the tiny media models: suppressed from answers, so a later
#: turn built from an answer stays a valid prompt.
SPECIAL_IDS = list(range(100, 128))


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
    """A prompt of a random conversation: text and media pieces, continued by a previous answer.

    `symbols` key each position (a token id, or a medium's hash with its place inside the medium's
    span); `spans` are the [start, end) positions of each medium's placeholders.
    """

    ids: list[int]
    symbols: list[Hashable]
    media: list[int]
    spans: list[tuple[int, int]]

    def add_text(self, tokens: list[int]) -> None: ...

    def add_medium(self, index: int) -> None: ...

    def continued(self, answer: list[int]) -> Any: ...


@contextmanager
def conversation_store(
    model: Any, *, pressure: bool = False, budget: tuple[int, int] | None = None, **options: Any
) -> Iterator[PrefixCache]:
    """A store for one random conversation, checked on exit: integrity, and no fallback but `entry_over_budget`.

    Under `pressure` it has `budget` bytes (memory, disk: a temporary folder), by default room for
    about 40 tokens in memory and 60 on disk, so entries are split, moved to disk, reloaded and
    dropped between requests. `options` go to `PrefixCache`.
    """
    with tempfile.TemporaryDirectory() as folder:
        if pressure:
            if budget is None:
                config = model.config.get_text_config()
                head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
                per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
                budget = (40 * per_token, 60 * per_token)
            limits = {"max_bytes": budget[0], "disk_dir": folder, "max_disk_bytes": budget[1]}
            options = {**limits, "save_on_exit": False, **options}
        with served(model, clean=False, **options) as store:
            yield store
            # Under pressure an answer longer than every budget is not stored, and says so.
            allowed = {"entry_over_budget"} if pressure else set()
            assert set(store.stats().fallbacks) <= allowed, store.stats().fallbacks
            store.check_integrity()


def expected_reuse(prompt: ChatPrompt, stored: list[list[Hashable]]) -> int:
    """The reference of the keying rules: the longest common prefix of `prompt`'s symbols with a stored
    sequence, capped at all but the prompt's last token and moved back to the start of a span it would cut."""
    return span_cut(longest_prefix(stored, prompt.symbols), len(prompt.ids), prompt.spans)


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


def converse_checked(
    store: PrefixCache,
    conversation: Iterable[tuple[Sequence[Any], bool]],
    start: Callable[[], ChatPrompt],
    run: Callable[[torch.Tensor, Any], Any],
    expected_reuse: Callable[[Any, list[list[Hashable]]], int],
    *,
    at_most: bool = False,
) -> None:
    """`converse`, asserting each request's hit tokens equal what `expected_reuse` predicts (or, `at_most`, no more).

    Args:
        store: The store `run` serves through.
        conversation: As for `converse`.
        start: A fresh prompt.
        run: Runs a prompt's ids cold and through `store` (the prompt given too) and returns the cached run.
        expected_reuse: (prompt, the symbols stored so far) -> the tokens the keying rules let it reuse.
        at_most: Only bound the reuse (evictions under memory pressure may lose some).
    """
    stored: list[list[Hashable]] = []

    def serve(prompt: Any) -> list[int]:
        ids = torch.tensor([prompt.ids])
        before = store.stats().hit_tokens
        out = run(ids, prompt)
        reused = store.stats().hit_tokens - before
        expected = expected_reuse(prompt, stored)
        assert reused <= expected if at_most else reused == expected, (reused, expected)
        answer: list[int] = out.sequences[0, ids.shape[1] :].tolist()
        stored.append(prompt.symbols + answer[:-1])
        return answer

    converse(conversation, start, serve)
