"""Scheduler: one loop that admits waiting rows between steps, steps while any row is active, and sleeps when idle.

An arrival never waits for the rows in flight to finish, only for the current step: between two steps
the loop ends the rows cancelled or past their deadline (storing what they computed), admits every waiting
row (up to `max_rows` in the batch; where it can, staging it to join in the step's own forward, `packed.py`),
then steps the batch once. Rows the batch cannot take
(`eligibility.py`: the model's profile, a setting the engine does not implement, a prefill the store ran
cold) run alone through `generate` in the loop, between two steps, counted under their reason.

Any other work on the model (a request with media, a transcription) is handed to the loop with `call`:
the loop runs it alone between two steps, so only the loop's thread ever drives the model, and its
`Future` gives the caller its result or its exception (which fails only that call).

The loop runs in a thread of its own (`start`; `torch.set_num_threads(num_threads)` there first when
given) or in the caller's thread (`run_until_idle`). On CPU, a loop started in a thread of its own runs at full
speed only where the model was loaded in a thread that has exited since (`threads.in_passing_thread`: torch's
OpenMP pools; `docs/serving.md`, "Where the loop runs, and where the model was loaded").

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
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from hf_prefix_cache.api.prefix_cache import store_of
from hf_prefix_cache.batching.alone import run_alone
from hf_prefix_cache.batching.batch import RunningBatch, Staging
from hf_prefix_cache.batching.eligibility import COLD, model_alone_reason, request_alone_reason
from hf_prefix_cache.batching.prefill import DEFAULT_CHUNK, Prefill, wants_chunks
from hf_prefix_cache.batching.rows import EndCallback, EndReason, Request, Row, TokenCallback
from hf_prefix_cache.store.contract import ReducedReuse

if TYPE_CHECKING:
    from types import TracebackType

    from hf_prefix_cache.api.prefix_cache import PrefixCache

logger = logging.getLogger("hf_prefix_cache")


class Load(NamedTuple):
    """What the loop holds now and has done so far (read from any thread; a snapshot, not a lock)."""

    rows: int  # rows decoding together in the batch
    alone: int  # a row or a call running alone now (0 or 1)
    waiting: int  # rows and calls waiting for the loop
    steps: int  # batched steps run so far
    row_steps: int  # rows those steps decoded, summed (row_steps / steps: the mean batch size)
    calls: int  # calls run so far
    pieces: int = 0  # prompt pieces prefilled for rows with many uncached tokens (`prefill.py`)
    joined_in_step: int = 0  # rows that joined in a step's own forward (`packed.py`)


class Scheduler:
    """The engine's loop over one model and its store.

    Args:
        prefix_cache: the model's store (rows reuse and store their prefixes there).
        max_rows: at most this many rows decode together; later arrivals wait for a row to leave.
        num_threads: `torch.set_num_threads` in the loop's own thread when it starts (None: as it is).
        prefill_chunk: a row with more uncached prompt tokens than this is prefilled this many tokens a cycle,
            the batch stepping between the pieces (`prefill.py`); 0 prefills every row whole.
        pack_joins: a row joins in the next step's own forward where the model allows it (`packed.py`); False:
            every row is prefilled by a forward of its own before it joins.
    """

    def __init__(
        self,
        prefix_cache: PrefixCache,
        max_rows: int = 32,
        num_threads: int | None = None,
        prefill_chunk: int = DEFAULT_CHUNK,
        pack_joins: bool = True,
    ) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0 (0: prefill whole), got {prefill_chunk}")
        self.prefill_chunk = prefill_chunk
        # Rows to prefill in pieces, in arrival order, and the one prefilling now: one at a time, so a later row
        # restores what an earlier one stored (a burst sharing an uncached system prompt computes it once).
        self._chunked: collections.deque[Row] = collections.deque()
        self._prefill: Prefill | None = None
        self._front = prefix_cache
        self.batch = RunningBatch(prefix_cache)
        self.max_rows = max_rows
        self.pack_joins = pack_joins
        self._num_threads = num_threads
        self._model_reason = model_alone_reason(store_of(prefix_cache).profile)
        self._waiting: collections.deque[Row] = collections.deque()
        self._calls: collections.deque[tuple[Callable[[], Any], Future[Any], str | None]] = collections.deque()
        self._alone: Row | None = None  # the row running alone now, cancelled by `stop`
        self._num_alone = 0
        self.steps = self.row_steps = self.calls = self.pieces = self.joined_in_step = 0
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ callers
    def submit(self, request: Request, on_token: TokenCallback | None = None, on_end: EndCallback | None = None) -> Row:
        """Queue `request`; the returned row streams through `on_token`, ends through `on_end` (or `Row.wait`).

        After `stop`, the row ends at once, cancelled and unrun.
        """
        row = Row(request, on_token, on_end)
        with self._wake:
            if not self._stopping:
                self._waiting.append(row)
                self._wake.notify()
                return row
        row.finish(EndReason.CANCELLED)  # the loop has stopped: nothing would run it
        return row

    def call(self, function: Callable[[], Any], reason: str | None = None) -> Future[Any]:
        """Run `function` in the loop, alone, between two steps; its future holds what it returned or raised.

        `reason` (``batch_alone:<why>``), when given, is counted in the store's fallbacks as the call runs.
        A call still waiting when the loop stops is cancelled (its future's `result` raises `CancelledError`).
        """
        future: Future[Any] = Future()
        with self._wake:
            if self._stopping:  # stopped (or stopping): nothing will run it
                future.cancel()
                return future
            self._calls.append((function, future, reason))
            self._wake.notify()
        return future

    def load(self) -> Load:
        """The rows and calls in the loop now, and its counters (for a stats line or a gauge)."""
        with self._wake:
            waiting = len(self._waiting) + len(self._calls) + self._prefilling()
        return Load(
            len(self.batch.rows),
            self._num_alone,
            waiting,
            self.steps,
            self.row_steps,
            self.calls,
            self.pieces,
            self.joined_in_step,
        )

    def start(self) -> None:
        """Run the loop in a thread of its own until `stop`."""
        if self._thread is not None:
            raise RuntimeError("the scheduler is running already")
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="hf-prefix-cache-batching", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the loop's thread after its current step; rows still in flight or waiting end cancelled (what they
        computed is stored), calls still waiting are cancelled.

        A row running alone is asked to stop at its next token. `timeout`: wait at most this long for the loop's
        thread (a call running alone cannot be interrupted); past it, the waiting rows and calls are cancelled and
        the rows in flight left as they are.
        """
        with self._wake:
            self._stopping = True
            self._wake.notify()
        alone = self._alone
        if alone is not None:
            alone.cancel()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("batching: the loop did not stop within %s s; its rows in flight are left", timeout)
                self._cancel_waiting()
                return
            self._thread = None
        self._cancel_all()

    def run_until_idle(self) -> None:
        """Run the loop in the calling thread until no row waits or decodes."""
        while self.cycle():
            pass

    # ------------------------------------------------------------------ the loop
    def cycle(self) -> bool:
        """Run the calls that wait, admit the rows that wait, end flagged rows, step once; whether any row or call
        waits or decodes still."""
        batch = self.batch
        while (waiting_call := self._next_call()) is not None:
            self._run_call(*waiting_call)
        if batch.rows:
            batch.end_flagged()
        while batch.held() + self._prefilling() < self.max_rows and (row := self._next_waiting()) is not None:
            if not self._admit(row):  # it waits for the next step, first in line
                with self._wake:
                    self._waiting.appendleft(row)
                break
        if self._prefilling():
            self._prefill_piece()
        if batch.held():
            self.steps += 1
            self.row_steps += len(batch.rows)
            self.joined_in_step += batch.staged()
            try:
                batch.step()
            except Exception as exc:
                logger.exception("batching: a decoding step failed; its rows end with the error")
                batch.fail(exc)
        with self._wake:
            return bool(batch.held() or self._waiting or self._calls or self._prefilling())

    def _serve(self) -> None:
        if self._num_threads is not None:
            torch.set_num_threads(self._num_threads)
        while True:
            with self._wake:
                while not (self._stopping or self._waiting or self._calls or self.batch.rows or self._prefilling()):
                    self._wake.wait()
                if self._stopping:
                    return
            try:
                self.cycle()
            except Exception as exc:  # the loop goes on for the rows that come next; the rows in flight end
                logger.exception("batching: the loop failed; its rows in flight end with the error")
                self.batch.fail(exc)

    def _next_waiting(self) -> Row | None:
        with self._wake:
            return self._waiting.popleft() if self._waiting else None

    def _next_call(self) -> tuple[Callable[[], Any], Future[Any], str | None] | None:
        with self._wake:
            return self._calls.popleft() if self._calls else None

    def _run_call(self, function: Callable[[], Any], future: Future[Any], reason: str | None) -> None:
        """Run one call alone; what it returns or raises goes to its future, never into the loop."""
        if not future.set_running_or_notify_cancel():
            return
        if reason is not None:
            store_of(self._front).record(ReducedReuse(reason))
        self._num_alone = 1
        try:
            result = function()
        except BaseException as exc:  # the call's failure is its caller's, not the loop's
            future.set_exception(exc)
        else:
            future.set_result(result)
        finally:
            self._num_alone = 0
            self.calls += 1

    def _admit(self, row: Row, chunks: bool = True) -> bool:
        """Join `row` to the batch (with `chunks`, queue it to be prefilled in pieces where it has many uncached
        tokens; stage it to join in the next step's own forward where it can), or run it alone (counted), or end
        it unrun when cancelled or expired; False, with nothing done, where it should wait for the next step."""
        if row.cancelled or row.expired(time.monotonic()):
            row.finish(EndReason.CANCELLED if row.cancelled else EndReason.TIMEOUT)
            return True
        reason = self._model_reason or request_alone_reason(row.request)
        try:
            if reason is None and chunks and wants_chunks(self._front, row, self.prefill_chunk):
                self._chunked.append(row)
                return True
            staging = self.batch.stage(row) if reason is None and self.pack_joins else Staging.OWN_PREFILL
            if staging is not Staging.OWN_PREFILL:
                return staging is Staging.STAGED
            if reason is None and self.batch.admit(row):
                return True
            self._alone, self._num_alone = row, 1
            if self._stopping:
                row.cancel()
            run_alone(self._front, row, reason or COLD)
        except Exception as exc:
            logger.exception("batching: a row's prefill failed; it ends with the error")
            row.finish(EndReason.ERROR, exc)
        finally:
            self._alone, self._num_alone = None, 0
        return True

    def _prefilling(self) -> int:
        """Rows prefilling in pieces or queued to."""
        return len(self._chunked) + (self._prefill is not None)

    def _prefill_piece(self) -> None:
        """Feed the prefilling row its next piece; once its prompt is all fed, it joins the batch. Without one, the
        next queued row starts (or, where what was stored since leaves it few uncached tokens, is admitted whole).
        A row cancelled or past its deadline ends first, keeping what it computed."""
        while self._prefill is None and self._chunked:
            row = self._chunked.popleft()
            if not row.cancelled and not row.expired(time.monotonic()):
                try:
                    if wants_chunks(self._front, row, self.prefill_chunk):
                        self._prefill = Prefill(self._front, row, self.prefill_chunk)
                        break
                except Exception as exc:  # a restore the store refuses: `generate`'s path falls back as it does
                    logger.warning("batching: a row's prefill in pieces could not start (%s); prefilled whole", exc)
            if not self._admit(row, chunks=False):  # it waits for the next step, first in line
                self._chunked.appendleft(row)
                break
        prefill = self._prefill
        if prefill is None:
            return
        row = prefill.row
        if row.cancelled or row.expired(time.monotonic()):
            self._prefill = None
            prefill.abandon(EndReason.CANCELLED if row.cancelled else EndReason.TIMEOUT)
            return
        try:
            logits = prefill.advance()
            self.pieces += 1
            if logits is not None:
                self._prefill = None
                self.batch.join(row, logits, prefill.finish())
        except Exception as exc:
            logger.exception("batching: a row's prefill failed; it ends with the error")
            self._prefill = None
            if row not in self.batch.rows:
                prefill.abandon(EndReason.ERROR, exc)

    def _cancel_all(self) -> None:
        for row in self.batch.rows:
            row.cancel()
        self.batch.end_flagged()
        self.batch.drop_joining(EndReason.CANCELLED)
        prefill, self._prefill = self._prefill, None
        if prefill is not None:
            prefill.abandon(EndReason.CANCELLED)
        while self._chunked:
            self._chunked.popleft().finish(EndReason.CANCELLED)
        self._cancel_waiting()

    def _cancel_waiting(self) -> None:
        with self._wake:
            waiting, self._waiting = list(self._waiting), collections.deque()
            calls, self._calls = list(self._calls), collections.deque()
        for row in waiting:
            row.finish(EndReason.CANCELLED)
        for _, future, _ in calls:
            future.cancel()

    def __enter__(self) -> Scheduler:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
