"""The API server's side of a model's process: each request sent with its ticket, its numbers read back.

transformers' handlers call their model's `EngineClient` (``generate_non_streaming``,
``generate_streaming``, ``submit``). `ScopedEngineClient` keeps those calls and sends every one as
`engine.run_job` (or `engine.run_call`) with the `Ticket` of the request whose handler is running
(`requests.pending`): its salt and tenant cross to the model's process, and the reports the job
sends in its own token stream come back to the request here: `Started` (the queue gauges),
`TimedOut` (503), `Ended` (``cached_tokens`` for the usage, Retry-After, and the result of a
request that does not stream). Before sending, the prompt and the new tokens asked for must fit
the model's context (`fit_context`).

`StoreModelManager` makes these clients, each model's process with a loader and a query `Channel`
of its own, lists the forced model under its served name, and asks the running processes for
their stores' stats and metrics (`Asker`).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable
from typing import Any

from fastapi import HTTPException
from transformers.cli.serving.model_manager import EngineClient, ModelManager
from transformers.cli.serving.utils import Detokenizer, _StreamError, canonical_model_id

from hf_prefix_cache.frontends.serve.engine import (
    Channel,
    Ended,
    Started,
    StoreLoader,
    Ticket,
    TimedOut,
    run_call,
    run_job,
)
from hf_prefix_cache.frontends.serve.metrics import ServeMetrics, now
from hf_prefix_cache.frontends.serve.requests import ServeRequest, pending
from hf_prefix_cache.frontends.serve.validate import RequestError

QUERY_TIMEOUT = 60.0


def context_len(config: Any) -> int | None:
    """The model's context length (its text config's ``max_position_embeddings``), or None when it has none."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def fit_context(config: Any, prompt_len: int, generation_kwargs: dict[str, Any], field: str | None) -> None:
    """Refuse (400, both numbers) a prompt that with its new tokens overflows the context; clamp a default length."""
    limit = context_len(config)
    if limit is None:
        return
    asked = generation_kwargs.get("max_new_tokens")
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
        generation_kwargs["max_new_tokens"] = limit - prompt_len


def check_bias(config: Any, generation_kwargs: dict[str, Any]) -> None:
    """Refuse (400) a ``logit_bias`` naming a token id outside the model's vocabulary, naming the id and its size."""
    bias = generation_kwargs.get("sequence_bias")
    if not bias:
        return
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text_config, "vocab_size", None)
    if not isinstance(vocab, int):
        return
    for ids in bias:
        for token_id in ids:
            if not 0 <= token_id < vocab:
                raise RequestError(
                    "logit_bias",
                    f"logit_bias names token id {token_id}, outside the model's vocabulary of {vocab} tokens "
                    f"(ids 0 to {vocab - 1})",
                )


def _timeout_message(waited: float) -> str:
    return f"the request waited {waited:.1f} s in the queue, past its timeout (--request-timeout); try again"


class _Job:
    """One request's job as its API server follows it: the reports of its process applied to the request.

    A cancel (the client left) waits until the job has started: transformers' runner drops a
    request cancelled while queued, and its prompt would never be stored; started, the job stops
    after its first token (`engine.StopWhenCancelled`) and the store keeps its prompt.
    """

    def __init__(self, request: ServeRequest | None, metrics: ServeMetrics | None) -> None:
        self.request = request
        self.metrics = metrics
        self.started = False
        self.timed_out: float | None = None
        self.ended: Ended | None = None
        self.task: asyncio.Task[Any] | None = None  # what sends the job and waits for its end
        self._cancel_pending = False
        self._left = False
        if metrics is not None:
            metrics.job_queued()

    def report(self, item: Any) -> bool:
        """Apply `item` if it is a report (True), else leave it to the caller (a token)."""
        if isinstance(item, Started):
            self.started = True
            if self.metrics is not None:
                self.metrics.job_started()
            if self._cancel_pending:
                self.cancel()
        elif isinstance(item, TimedOut):
            self.timed_out = item.waited
        elif isinstance(item, Ended):
            self.ended = item
            if self.request is not None:
                self.request.cached_tokens += item.finished.cached_tokens
        else:
            return False
        return True

    def cancel(self) -> None:
        """Stop the job: now if it has started (or ended), else as soon as it starts."""
        if not self.started and self.timed_out is None and self.ended is None:
            self._cancel_pending = True
        elif self.task is not None:
            self.task.cancel()

    def leave(self, task: Any = None) -> None:
        """The job is over, however it ended (once): the gauges and Retry-After."""
        if isinstance(task, asyncio.Future) and not task.cancelled():
            task.exception()  # retrieved: a request whose client left has no one else to read it
        if self._left:
            return
        self._left = True
        if self.metrics is not None:
            finished = self.ended.finished if self.ended is not None else None
            self.metrics.job_left(self.started, None if finished is None else finished.ended - finished.arrival)


class _Collector:
    """The streamer of a request that does not stream: only reports come, then the end."""

    def __init__(self, job: _Job) -> None:
        self.job = job
        self.total_tokens = 0

    def put_token(self, token: Any) -> None:
        self.job.report(token)

    def end(self) -> None:
        pass

    def cancel(self) -> None:
        self.job.cancel()


class _ReportingDetokenizer(Detokenizer):
    """transformers' `Detokenizer`, reading the job's reports out of its token stream; a cancel waits for the start."""

    job: _Job

    def put_token(self, token_id: Any) -> None:
        if not self.job.report(token_id):
            super().put_token(token_id)
        elif self.job.timed_out is not None:
            self._queue.put_nowait(_StreamError(_timeout_message(self.job.timed_out)))

    def cancel(self) -> None:
        self.job.cancel()


class ScopedEngineClient(EngineClient):
    """transformers' `EngineClient`, each call sent as a job of ours with its request's ticket (see above)."""

    metrics: ServeMetrics | None = None
    asker: Asker | None = None

    def start(self, on_progress: Callable[[dict[str, Any]], None] | None = None) -> None:
        """Start the model's process (if it is not running) with a query channel of its own.

        A fresh channel each time: a process stopped while it waited on its queries queue leaves that
        queue's lock taken, and the next process would wait on it forever.
        """
        if not self.process_running and not self.externally_managed:
            loader: StoreLoader = self.loader  # type: ignore[assignment]
            self.loader = loader = loader.for_engine()
            assert loader.channel is not None
            self.asker = Asker(loader.channel)
        super().start(on_progress)

    def _ticket(self, request: ServeRequest | None, stream: bool) -> Ticket:
        if request is None:
            return Ticket(None, None, self.model_id, now(), None, stream)
        request.model_name = request.model_name or self.model_id
        return Ticket(request.salt, request.tenant, request.model_name, request.arrival, request.deadline, stream)

    async def generate_non_streaming(self, inputs: dict[str, Any], generation_kwargs: dict[str, Any]) -> Any:
        request = pending()
        prompt_len = int(inputs["input_ids"].shape[-1])
        fit_context(self.model_config, prompt_len, generation_kwargs, request.max_new_field if request else None)
        check_bias(self.model_config, generation_kwargs)
        tokens = await self._run(request, run_job, (dict(inputs), generation_kwargs))
        return self.processor.decode(tokens, skip_special_tokens=True), prompt_len, tokens

    def generate_streaming(
        self, inputs: dict[str, Any], generation_kwargs: dict[str, Any], response_parser: Any = None
    ) -> tuple[asyncio.Queue[Any], Any]:
        request = pending()
        prompt_len = int(inputs["input_ids"].shape[-1])
        fit_context(self.model_config, prompt_len, generation_kwargs, request.max_new_field if request else None)
        check_bias(self.model_config, generation_kwargs)
        return self._stream(request, run_job, (dict(inputs), generation_kwargs), response_parser)

    async def submit(self, function: Callable[..., Any], *args: Any) -> Any:
        return await self._run(pending(), run_call, (function, args))

    def submit_streaming(self, function: Callable[..., Any], *args: Any) -> tuple[asyncio.Queue[Any], Any]:
        return self._stream(pending(), run_call, (function, args), None)

    async def _run(self, request: ServeRequest | None, job_function: Any, args: tuple[Any, ...]) -> Any:
        job = _Job(request, self.metrics)
        collector = _Collector(job)
        if request is not None:
            request.cancel = collector.cancel
        submitted = (job_function, (self._ticket(request, False), *args))
        job.task = asyncio.ensure_future(self._send_request("submit", args=submitted, streamer=collector))  # type: ignore[arg-type]
        job.task.add_done_callback(job.leave)
        try:
            await asyncio.shield(job.task)
        except asyncio.CancelledError:  # the client left: the job stops once started (see `_Job`)
            job.cancel()
            raise
        if job.timed_out is not None:
            raise HTTPException(503, _timeout_message(job.timed_out), headers={"Retry-After": "1"})
        return None if job.ended is None else job.ended.result

    def _stream(
        self, request: ServeRequest | None, job_function: Any, args: tuple[Any, ...], response_parser: Any
    ) -> tuple[asyncio.Queue[Any], Any]:
        output: asyncio.Queue[Any] = asyncio.Queue()
        tokenizer: Any = getattr(self.processor, "tokenizer", self.processor)
        streamer = _ReportingDetokenizer(tokenizer._tokenizer, output, response_parser=response_parser)
        streamer.job = job = _Job(request, self.metrics)
        if request is not None:
            request.cancel = streamer.cancel
        submitted = (job_function, (self._ticket(request, True), *args))

        async def wait_for_the_end() -> None:
            try:
                await self._send_request("submit", args=submitted, streamer=streamer)
                if job.timed_out is None:
                    streamer.end()
            except asyncio.CancelledError:
                pass
            except Exception as exc:
                output.put_nowait(_StreamError(str(exc)))
            finally:
                job.leave()

        streamer.task = job.task = asyncio.create_task(wait_for_the_end())
        return output, streamer


class Asker:
    """Asks one model's process a query (`engine.EngineState.answer`) and waits for its reply, from any thread."""

    def __init__(self, channel: Channel, api_server: int = 0) -> None:
        self.channel = channel
        self.api_server = api_server
        self._ids = itertools.count()
        self._waiting: dict[int, list[Any]] = {}
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None

    def ask(self, kind: str, arg: Any = None, timeout: float = QUERY_TIMEOUT) -> Any:
        """The process's answer to `kind` (raises what failed it, TimeoutError past `timeout` seconds)."""
        done = threading.Event()
        slot: list[Any] = [done]
        with self._lock:
            query_id = next(self._ids)
            self._waiting[query_id] = slot
            if self._reader is None:
                self._reader = threading.Thread(target=self._read, name="store-replies", daemon=True)
                self._reader.start()
        self.channel.queries.put((self.api_server, query_id, kind, arg))
        if not done.wait(timeout):
            with self._lock:
                self._waiting.pop(query_id, None)
            raise TimeoutError(f"the model's process did not answer {kind!r} in {timeout:.0f} s")
        reply = slot[1]
        if isinstance(reply, Exception):
            raise reply
        return reply

    def _read(self) -> None:
        replies = self.channel.replies[self.api_server]
        while True:
            query_id, reply = replies.get()
            with self._lock:
                slot = self._waiting.pop(query_id, None)
            if slot is not None:
                slot.append(reply)
                slot[0].set()


class StoreModelManager(ModelManager):
    """transformers' `ModelManager`, its models' processes each with a store and a query channel of their own.

    Args:
        loader: how models load (and get their store).
        metrics: this API server's metrics, which every client feeds.
        served_name: the forced model's name in ``/v1/models`` and answers.
        api_server: this API server's index (several: `--api-server-count`).
        **kwargs: `ModelManager`'s (generation_state, model_timeout, force_model, engine_connection).
    """

    def __init__(
        self,
        loader: StoreLoader,
        metrics: ServeMetrics | None = None,
        served_name: str | None = None,
        api_server: int = 0,
        **kwargs: Any,
    ) -> None:
        self.metrics = metrics
        self.served_name = served_name
        self.api_server = api_server
        super().__init__(loader, **kwargs)

    def _client(self, model_id: str, **kwargs: Any) -> ScopedEngineClient:
        loader: StoreLoader = self.loader  # type: ignore[assignment]
        engine = ScopedEngineClient(model_id, loader, self.generation_state, **kwargs)
        engine.metrics = self.metrics
        if kwargs.get("connection") is not None and loader.channel is not None:
            engine.asker = Asker(loader.channel, self.api_server)  # the supervisor's process, shared
        return engine

    def preload_engine(self, force_model: str, engine_connection: tuple[Any, ...] | None) -> None:
        model_id = canonical_model_id(force_model)
        engine = self._client(model_id, connection=engine_connection)
        self.engines[model_id] = engine
        if engine_connection is None:
            engine.start()

    def get_engine(self, model: str | None) -> EngineClient:
        if self.force_model is not None or model is None:
            return super().get_engine(model)
        model_id = canonical_model_id(model)
        if model_id not in self.engines:
            self.engines.setdefault(model_id, self._client(model_id, timeout=self.model_timeout))
        return self.engines[model_id]

    def running(self) -> list[tuple[str, Asker]]:
        """The models whose process runs now, with the asker of each."""
        return [
            (model_id, engine.asker)
            for model_id, engine in list(self.engines.items())
            if isinstance(engine, ScopedEngineClient) and engine.process_running and engine.asker is not None
        ]

    def list_models(self, cache_dir: str | None = None) -> list[dict[Any, Any]]:
        """`/v1/models`: the forced model under its served name, else transformers' listing."""
        models = list(super().list_models(cache_dir))
        if self.force_model is not None and self.served_name:
            for model in models:
                model["id"] = self.served_name
        return models
