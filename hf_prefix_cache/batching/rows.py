"""A row in flight: its request (prompt ids, salt, settings), the tokens it generated, its callbacks, why it ended.

`Request` is what a caller asks (immutable); `Row` is that request's life in the engine: the tokens chosen so
far, the token chosen but not fed yet, where it sits in the running batch, the scope its store calls
count in, and, once it ends, its `EndReason`. The engine calls `on_token` for every token as it is chosen
and `on_end` once, from the thread that runs the batch (an exception in one is logged, never raised into the
batch: the other rows go on).

Example:
    >>> row = Row(Request((5, 6, 7), max_new_tokens=4, end_ids=frozenset({2})))
    >>> row.emit(9); row.emit(2)
    >>> row.tokens, row.ended_by()
    ([9, 2], <EndReason.EOS: 'eos'>)
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hf_prefix_cache.batching.sampling import Chooser, Sampling
from hf_prefix_cache.batching.stops import StopStrings
from hf_prefix_cache.store.lookup import as_token_list

if TYPE_CHECKING:
    import torch

    from hf_prefix_cache.store.scope import RequestScope

logger = logging.getLogger("hf_prefix_cache")


class EndReason(enum.Enum):
    """Why a row left the batch."""

    EOS = "eos"  # it chose an end token (kept in its tokens, as `generate` keeps it)
    STOP = "stop"  # its tokens ended with one of its stop sequences
    LENGTH = "length"  # it reached its `max_new_tokens`
    CANCELLED = "cancelled"  # its caller cancelled it (what it computed is stored)
    TIMEOUT = "timeout"  # its deadline passed (what it computed is stored)
    ERROR = "error"  # the model raised while it ran (`Row.error` holds the exception)


@dataclass(frozen=True, slots=True)
class Request:
    """What a caller asks of the engine for one sequence.

    Attributes:
        ids: the prompt's token ids (given as a tensor, a list or a tokenizer's output; kept as a tuple).
        max_new_tokens: at most this many tokens are generated.
        sampling: how each token is chosen (`sampling.Sampling`; greedy by default).
        end_ids: token ids that end the answer (the model's EOS ids); the end token is kept.
        stop_sequences: token id sequences that end the answer once generated (kept too).
        stop_strings: strings that end the answer where `generate(..., stop_strings=, tokenizer=)` ends it
            (`batching/stops.py`; a single string is taken as one); they need `tokenizer`. `Row` builds their
            matcher, so one that no token can end raises `ValueError` there (in `Scheduler.submit`).
        tokenizer: the model's tokenizer, for `stop_strings`.
        salt: the store namespace's salt (a tenant): reuse and store only under it.
        timeout_s: seconds from submission after which the row ends (None: never).
        generate_kwargs: further `generate` settings (beams, ``no_repeat_ngram_size``, ...): a row with any runs
            alone.
        keep_logits: keep each step's `[vocab]` logits on the row (tests compare them with a cold run's).
        inputs: the model inputs a processor returned beside the ids (`pixel_values`, `image_grid_thw`,
            `mm_token_type_ids`, ...), for one row: passed to the prompt's prefill (`batching/media.py`).
    """

    ids: Sequence[int]
    max_new_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    end_ids: frozenset[int] = frozenset()
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    stop_strings: tuple[str, ...] = ()
    tokenizer: Any = field(default=None, repr=False, compare=False)
    salt: str | None = None
    timeout_s: float | None = None
    generate_kwargs: dict[str, Any] = field(default_factory=dict)
    keep_logits: bool = False
    inputs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", tuple(as_token_list(self.ids)))  # a tensor, a list, a tokenizer's output
        if taken := sorted({"input_ids", "attention_mask"} & set(self.inputs)):
            raise ValueError(f"pass the prompt as `ids`, not in `inputs` (drop {taken} from the processor's output)")
        if len(self.ids) == 0:
            raise ValueError("a request needs at least one prompt token")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if isinstance(self.stop_strings, str):
            object.__setattr__(self, "stop_strings", (self.stop_strings,))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if self.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need the model's tokenizer: pass Request(..., tokenizer=tokenizer)")


#: Called with the row and the token it just chose.
TokenCallback = Callable[["Row", int], None]
#: Called once with the row when it has ended (its `end_reason` set, its sequence stored).
EndCallback = Callable[["Row"], None]


class Row:
    """One request's life in the engine; read `tokens`, `end_reason`, `cached_tokens` once it ended.

    Args:
        request: what was asked.
        on_token: called for each chosen token (in the engine's thread).
        on_end: called once when the row ends.
    """

    def __init__(
        self, request: Request, on_token: TokenCallback | None = None, on_end: EndCallback | None = None
    ) -> None:
        self.request = request
        self.on_token = on_token
        self.on_end = on_end
        self.tokens: list[int] = []
        self.logits: list[torch.Tensor] = []
        self.chooser = Chooser(request.sampling, request.end_ids, request.ids)
        self.stops = StopStrings(request.tokenizer, request.stop_strings) if request.stop_strings else None
        self.submitted_at = time.monotonic()
        self.first_token_at: float | None = None
        self.ended_at: float | None = None
        self.end_reason: EndReason | None = None
        self.error: BaseException | None = None
        self.scope: RequestScope | None = None  # the store's request scope its calls count in (set when admitted)
        self.alone_reason: str | None = None  # why it ran alone through `generate`, if it did
        self.pad = 0  # its left padding columns in the running batch
        self._cancelled = threading.Event()
        self._done = threading.Event()

    # ------------------------------------------------------------ the caller's side
    def cancel(self) -> None:
        """Ask the engine to end this row at its next step (what it computed so far is stored)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        """Whether `cancel` was called."""
        return self._cancelled.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the row has ended (True), or `timeout` seconds passed (False)."""
        return self._done.wait(timeout)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens restored from the store rather than computed (as the sequential path reports them)."""
        return self.scope.cached_tokens if self.scope is not None else 0

    # ------------------------------------------------------------ the engine's side
    @property
    def fed_ids(self) -> list[int]:
        """The ids the row's cache holds: its prompt and every token but the last (never fed)."""
        return [*self.request.ids, *self.tokens[:-1]]

    @property
    def pending(self) -> int:
        """The last chosen token: the next one the model is fed."""
        return self.tokens[-1]

    def expired(self, now: float) -> bool:
        """Whether the row's deadline passed at `now` (monotonic seconds)."""
        timeout = self.request.timeout_s
        return timeout is not None and now - self.submitted_at >= timeout

    def emit(self, token: int) -> None:
        """Take `token` as the row's next one and tell the caller."""
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.tokens.append(token)
        if self.on_token is not None:
            _call_back(self.on_token, self, token)

    def ended_by(self, tokens: Sequence[int] | None = None) -> EndReason | None:
        """Why the row ends after its last token (or after `tokens`, its answer so far), or None while it goes on."""
        tokens = self.tokens if tokens is None else tokens
        if tokens and tokens[-1] in self.request.end_ids:
            return EndReason.EOS
        for stop in self.request.stop_sequences:
            if stop and tuple(tokens[-len(stop) :]) == stop:
                return EndReason.STOP
        if self.stops is not None and self.stops.hit(self.request.ids, tokens):
            return EndReason.STOP
        if len(tokens) >= self.request.max_new_tokens:
            return EndReason.LENGTH
        return None

    def finish(self, reason: EndReason, error: BaseException | None = None) -> None:
        """Mark the row ended for `reason` and tell the caller (once)."""
        if self._done.is_set():
            return
        self.end_reason, self.error, self.ended_at = reason, error, time.monotonic()
        if self.on_end is not None:
            _call_back(self.on_end, self)
        self._done.set()


def _call_back(callback: Callable[..., None], *args: Any) -> None:
    """Call a caller's callback; an exception in it is logged, never raised into the batch (the other rows go on)."""
    try:
        callback(*args)
    except Exception:
        logger.exception("batching: a row's callback raised")
