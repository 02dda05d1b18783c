"""Each request's job on the model's inference thread: its limits checked, its scope active, its times measured.

transformers' `GenerateManager` runs one ``model.generate`` at a time on a persistent thread.
`ScopedGenerateManager` starts each job as that manager does (its `DirectStreamer` and queue for
a stream), and adds, without copying transformers' code:

- **context**: prompt plus the new tokens asked for must fit the model's context
  (``max_position_embeddings``): over it is a 400 with both numbers, before any compute; when the
  request named no length, the default is clamped to what the context leaves;
- **deadline**: a job still queued at its request's deadline is answered 503 and never runs;
  one that starts is given the time left as ``max_time``;
- **keep what was computed**: a cancelled stream (the client left) stops its `generate` after the
  current token through a stopping criterion instead of an exception, so `generate` returns and
  the store keeps the prompt's states (and the tokens so far), exact as any finished request's;
- **scope and timing**: the job runs inside the request's `RequestScope`; `Progress` sees every
  token, for time to first token and tokens per second (`metrics.py`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any

import torch
from fastapi import HTTPException
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.cli.serving.utils import DirectStreamer, GenerateManager, _StreamError

from hf_prefix_cache.frontends.serve.metrics import Finished, ServeMetrics, now
from hf_prefix_cache.frontends.serve.requests import ServeRequest, pending
from hf_prefix_cache.frontends.serve.validate import RequestError
from hf_prefix_cache.store.scope import active


class Progress:
    """The streamer `generate` is given: counts and times its tokens, forwards them to a stream, stops on cancel."""

    def __init__(self, inner: DirectStreamer | None = None) -> None:
        self.inner = inner
        self.cancelled = threading.Event()
        self.first_token_at: float | None = None
        self.num_tokens = 0
        self.was_cancelled = False  # cancelled before generate ended (a stream closed after its end is not)
        self._prompt_seen = False

    @property
    def total_tokens(self) -> int:
        """Tokens generated (what transformers' handlers read of their streamer)."""
        return self.num_tokens

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate's first put is the prompt
            self._prompt_seen = True
            if self.inner is not None:
                self.inner.put(value)
            return
        if self.first_token_at is None:
            self.first_token_at = now()
        self.num_tokens += int(value.numel())
        if self.inner is not None and not self.cancelled.is_set():
            self.inner.put(value)

    def end(self) -> None:
        self.was_cancelled = self.cancelled.is_set()
        if self.inner is not None:
            self.inner.end()

    def cancel(self) -> None:
        """Stop `generate` after the current token (what a handler calls when its client left)."""
        self.cancelled.set()


class StopWhenCancelled(StoppingCriteria):
    """Ends generation (normally, so the store keeps what was computed) once `progress` is cancelled."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        done = self.progress.cancelled.is_set()
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


def context_len(model: Any) -> int | None:
    """The model's context length (its text config's ``max_position_embeddings``), or None when it has none."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def fit_context(model: Any, inputs: dict[str, Any], gen_config: Any, field: str | None) -> None:
    """Refuse (400, both numbers) a prompt that with its new tokens overflows the context; clamp a default length."""
    limit = context_len(model)
    if limit is None:
        return
    prompt_len = int(inputs["input_ids"].shape[-1])
    asked = gen_config.max_new_tokens
    if prompt_len >= limit:
        raise RequestError(
            "messages", f"the prompt has {prompt_len} tokens; the model's context is {limit} tokens: shorten the prompt"
        )
    if asked is not None and prompt_len + asked > limit:
        if field is not None:
            raise RequestError(
                field,
                f"the prompt has {prompt_len} tokens and {field} asks for {asked} more: {prompt_len + asked} in all, "
                f"over the model's context of {limit} tokens; ask for at most {limit - prompt_len}",
            )
        gen_config.max_new_tokens = limit - prompt_len


class ScopedGenerateManager(GenerateManager):
    """transformers' sequential `GenerateManager`, each job checked, scoped, timed and cancellable as above.

    Args:
        metrics: where jobs are counted and timed (None: nowhere).
    """

    def __init__(self, metrics: ServeMetrics | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.metrics = metrics

    def generate_streaming(
        self,
        model: Any,
        processor: Any,
        inputs: dict[str, Any],
        gen_config: Any,
        request_id: str,
        response_parser: Any = None,
    ) -> tuple[asyncio.Queue[Any], Any]:
        request = pending()
        fit_context(model, inputs, gen_config, request.max_new_field if request is not None else None)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        tokenizer = getattr(processor, "tokenizer", processor)._tokenizer
        progress = Progress(DirectStreamer(tokenizer, loop, queue, response_parser=response_parser))

        def run() -> None:
            try:
                model.generate(**self._kwargs(model, processor, inputs, gen_config, progress))
            except Exception as exc:
                loop.call_soon_threadsafe(queue.put_nowait, _StreamError(_message(exc)))

        self._start(run, request, inputs, progress, gen_config)
        return queue, progress

    async def generate_non_streaming(
        self, model: Any, processor: Any, inputs: dict[str, Any], gen_config: Any, request_id: str
    ) -> tuple[str, int, Any]:
        request = pending()
        fit_context(model, inputs, gen_config, request.max_new_field if request is not None else None)
        progress = Progress()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Any] = loop.create_future()

        def run() -> None:
            try:
                result = model.generate(**self._kwargs(model, processor, inputs, gen_config, progress))
            except BaseException as exc:
                loop.call_soon_threadsafe(_settle, done, None, exc)
                return
            loop.call_soon_threadsafe(_settle, done, result, None)

        self._start(run, request, inputs, progress, gen_config, done)
        sequences = await done
        input_len = int(inputs["input_ids"].shape[-1])
        generated = sequences[0, input_len:]
        return processor.decode(generated, skip_special_tokens=True), input_len, generated

    @staticmethod
    def _kwargs(
        model: Any, processor: Any, inputs: dict[str, Any], gen_config: Any, progress: Progress
    ) -> dict[str, Any]:
        kwargs = {**inputs, "generation_config": gen_config, "tokenizer": processor, "streamer": progress}
        kwargs["stopping_criteria"] = StoppingCriteriaList([StopWhenCancelled(progress)])
        if hasattr(model, "has_talker"):
            kwargs["generation_mode"] = "text"  # as transformers' manager: text only
        return kwargs

    def _start(
        self,
        run: Callable[[], None],
        request: ServeRequest | None,
        inputs: dict[str, Any],
        progress: Progress,
        gen_config: Any,
        done: asyncio.Future[Any] | None = None,
    ) -> None:
        """Queue `run` on the inference thread, within the request's scope, its deadline and its metrics."""
        metrics = self.metrics
        if request is not None:
            request.cancel = progress.cancel
        if metrics is not None:
            metrics.job_queued()
        loop = asyncio.get_running_loop()

        def job() -> None:
            started = now()
            if metrics is not None:
                metrics.job_started()
            finished: Finished | None = None
            try:
                if request is not None and request.deadline is not None:
                    left = request.deadline - started
                    if left <= 0:
                        _time_out(loop, done, progress, started - request.arrival)
                        return
                    gen_config.max_time = left if gen_config.max_time is None else min(left, gen_config.max_time)
                with active(request.scope if request is not None else None):
                    run()
                if request is not None:
                    finished = Finished(
                        model=request.model_name,
                        tenant=request.tenant,
                        arrival=request.arrival,
                        started=started,
                        first_token_at=progress.first_token_at,
                        ended=now(),
                        prompt_tokens=int(inputs["input_ids"].shape[-1]),
                        cached_tokens=request.scope.cached_len,
                        generated_tokens=progress.num_tokens,
                        cancelled=progress.was_cancelled,
                    )
            finally:
                if metrics is not None:
                    metrics.job_finished(finished)

        self.submit(job)


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _time_out(
    loop: asyncio.AbstractEventLoop, done: asyncio.Future[Any] | None, progress: Progress, waited: float
) -> None:
    message = f"the request waited {waited:.1f} s in the queue, past its timeout (--request-timeout); try again"
    if done is not None:
        loop.call_soon_threadsafe(_settle, done, None, HTTPException(503, message, headers={"Retry-After": "1"}))
    elif progress.inner is not None:
        progress.inner._enqueue(_StreamError(message))


def _message(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".replace('"', "'")
