"""Scheduler: one loop that admits waiting rows between steps, steps while any row is active, and sleeps when idle.

An arrival never waits for the rows in flight to finish, only for the current step: between two steps
the loop admits every waiting row (up to `max_rows` in the batch), then ends the rows cancelled or past
their deadline (storing what they computed), then steps the batch once. Rows the batch cannot take
(`eligibility.py`: the model's profile, a setting the engine does not implement, a prefill the store ran
cold) run alone through `generate` in the loop, between two steps, counted under their reason.

The loop runs in a thread of its own (`start`; `torch.set_num_threads(num_threads)` there first when
given) or in the caller's thread (`run_until_idle`): on CPU, where the loop runs changes how fast torch
decodes (`docs/serving.md`, "Batching engine").

Example:
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from hf_prefix_cache import PrefixCache
    >>> from hf_prefix_cache.batching.rows import Request
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).eval()
    >>> with Scheduler(PrefixCache(model)) as scheduler:
    ...     rows = [scheduler.submit(Request(list(range(4, 4 + n)), max_new_tokens=3)) for n in (12, 7)]
    ...     [row.wait(timeout=60) for row in rows]
    [True, True]
    >>> [row.end_reason.value for row in rows]
    ['length', 'length']
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import TYPE_CHECKING

import torch

from hf_prefix_cache.api.prefix_cache import store_of
from hf_prefix_cache.batching.alone import run_alone
from hf_prefix_cache.batching.batch import RunningBatch
from hf_prefix_cache.batching.eligibility import COLD, model_alone_reason, request_alone_reason
from hf_prefix_cache.batching.rows import EndCallback, EndReason, Request, Row, TokenCallback

if TYPE_CHECKING:
    from types import TracebackType

    from hf_prefix_cache.api.prefix_cache import PrefixCache

logger = logging.getLogger("hf_prefix_cache")


class Scheduler:
    """The engine's loop over one model and its store.

    Args:
        prefix_cache: the model's store (rows reuse and store their prefixes there).
        max_rows: at most this many rows decode together; later arrivals wait for a row to leave.
        num_threads: `torch.set_num_threads` in the loop's own thread when it starts (None: as it is).
    """

    def __init__(self, prefix_cache: PrefixCache, max_rows: int = 32, num_threads: int | None = None) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self._front = prefix_cache
        self.batch = RunningBatch(prefix_cache)
        self.max_rows = max_rows
        self._num_threads = num_threads
        self._model_reason = model_alone_reason(store_of(prefix_cache).profile)
        self._waiting: collections.deque[Row] = collections.deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ callers
    def submit(self, request: Request, on_token: TokenCallback | None = None, on_end: EndCallback | None = None) -> Row:
        """Queue `request`; the returned row streams through `on_token`, ends through `on_end` (or `Row.wait`)."""
        row = Row(request, on_token, on_end)
        with self._wake:
            self._waiting.append(row)
            self._wake.notify()
        return row

    def start(self) -> None:
        """Run the loop in a thread of its own until `stop`."""
        if self._thread is not None:
            raise RuntimeError("the scheduler is running already")
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="hf-prefix-cache-batching", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop's thread after its current step; rows still in flight or waiting end cancelled."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._cancel_all()

    def run_until_idle(self) -> None:
        """Run the loop in the calling thread until no row waits or decodes."""
        while self.cycle():
            pass

    # ------------------------------------------------------------------ the loop
    def cycle(self) -> bool:
        """Admit what waits, end flagged rows, step once; whether any row waits or decodes still."""
        batch = self.batch
        while len(batch.rows) < self.max_rows and (row := self._next_waiting()) is not None:
            self._admit(row)
        if batch.rows:
            batch.end_flagged()
        if batch.rows:
            try:
                batch.step()
            except Exception as exc:
                logger.exception("batching: a decoding step failed; its rows end with the error")
                batch.fail(exc)
        with self._wake:
            return bool(batch.rows or self._waiting)

    def _serve(self) -> None:
        if self._num_threads is not None:
            torch.set_num_threads(self._num_threads)
        while True:
            with self._wake:
                while not (self._stopping or self._waiting or self.batch.rows):
                    self._wake.wait()
                if self._stopping:
                    return
            self.cycle()

    def _next_waiting(self) -> Row | None:
        with self._wake:
            return self._waiting.popleft() if self._waiting else None

    def _admit(self, row: Row) -> None:
        """Join `row` to the batch, or run it alone (counted), or end it unrun when cancelled or expired."""
        if row.cancelled or row.expired(time.monotonic()):
            row.finish(EndReason.CANCELLED if row.cancelled else EndReason.TIMEOUT)
            return
        reason = self._model_reason or request_alone_reason(row.request)
        try:
            if reason is None and self.batch.admit(row):
                return
            run_alone(self._front, row, reason or COLD)
        except Exception as exc:
            logger.exception("batching: a row's prefill failed; it ends with the error")
            row.finish(EndReason.ERROR, exc)

    def _cancel_all(self) -> None:
        for row in self.batch.rows:
            row.cancel()
        self.batch.end_flagged()
        with self._wake:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for row in waiting:
            row.finish(EndReason.CANCELLED)

    def __enter__(self) -> Scheduler:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
