"""The model's process: the store beside the model, each request run in its own scope, its numbers sent back.

transformers 5.25 runs each model in a process of its own (the engine), spawned with a pickled
`ModelLoader`; the API servers send it requests through queues and read back tokens and results.
This module is what runs there, without copying transformers' runner:

- `StoreLoader` (a `ModelLoader`, importable for spawn) loads the model as transformers does, in a
  thread that then exits (`batching.threads.in_passing_thread`: so that the main thread keeps no
  OpenMP pool beside the decoding thread's), and attaches its `PrefixCache(model, attach="all")` with
  the CLI's options; it starts the thread that
  answers the API servers' queries (stats, integrity, metrics: `Channel`) beside generation, and on
  SIGTERM (an unloaded model) saves a store with a disk tier first.
- `run_job` is what the API servers submit for each request (`GenerateRunner.submit`, always as a
  streaming request, so that it knows its request id): with batching on (`batched.py`) its row joins
  the one loop that decodes every request in flight; else it runs the request's ``generate`` in a
  ``with store.request(salt)`` block (its `Ticket` carries the tenant's salt across), gives it the time
  left before its deadline as ``max_time`` (a job still queued at its deadline never runs), stops
  it after the current token when the request is cancelled (normally: the store keeps what was
  computed), and sends back, in the request's own token stream, `Started` and then `Ended` (its
  `Finished` numbers, ``cached_tokens`` included, and the result of a request that does not stream).
"""

from __future__ import annotations

import copy
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.cli.serving.model_manager import ModelLoader

from hf_prefix_cache.batching.cpu_linear import Choice, LinearKernels, use_onednn_linears
from hf_prefix_cache.batching.threads import in_passing_thread
from hf_prefix_cache.frontends.serve import batched
from hf_prefix_cache.frontends.serve.batched import Batching, BatchOptions
from hf_prefix_cache.frontends.serve.metrics import Finished, JobMetrics, now

if TYPE_CHECKING:
    from hf_prefix_cache.store.scope import RequestScope

logger = logging.getLogger("hf_prefix_cache")


# ------------------------------------------------------------------ what crosses
@dataclass(frozen=True, slots=True)
class Ticket:
    """What crosses to the model's process with a request, beside its inputs and generation settings.

    Attributes:
        salt: the request's store salt (its tenant's namespace and its ``cache_salt``; `requests.tenant_salt`).
        tenant: its tenant, for the metrics (None: the operator).
        model_name: the name it is answered and measured under.
        arrival: when it arrived (`metrics.now`, a clock every process of the machine shares).
        deadline: when it must be done (None: never).
        stream: whether its tokens stream back one by one (else they come back with `Ended`).
    """

    salt: str | None
    tenant: str | None
    model_name: str
    arrival: float
    deadline: float | None
    stream: bool


@dataclass(frozen=True, slots=True)
class Started:
    """The job left the queue and runs (sent in its token stream)."""

    started: float


@dataclass(frozen=True, slots=True)
class TimedOut:
    """The job was still queued at its deadline and never ran."""

    waited: float


@dataclass(frozen=True, slots=True)
class Ended:
    """The job ran: its numbers, and the result of a job whose tokens did not stream."""

    finished: Finished
    result: Any = None


# ------------------------------------------------------------------ one job
class Progress:
    """The streamer `generate` is given: times and counts the tokens, sends them on, notices a cancel.

    Args:
        streamer: transformers' streamer of the request (its `runner` and `request_id`).
        forward: send each token to the API server as it comes (a streaming request).
    """

    def __init__(self, streamer: Any, forward: bool) -> None:
        self.runner = streamer.runner
        self.request_id: int = streamer.request_id
        self.forward = forward
        self.first_token_at: float | None = None
        self.num_tokens = 0
        self.was_cancelled = False
        self._prompt_seen = False

    @property
    def is_cancelled(self) -> bool:
        """Whether the API server cancelled the request (its client left)."""
        return self.request_id in self.runner.cancelled_request_ids

    def send(self, item: Any) -> None:
        """Send `item` (a report) in the request's token stream, ahead of its end."""
        self.runner.send_results([self.request_id], [item], [])

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate's first put is the prompt
            self._prompt_seen = True
            return
        if self.first_token_at is None:
            self.first_token_at = now()
        tokens = value.reshape(-1).tolist()
        self.num_tokens += len(tokens)
        self.runner.count_tokens(generated=len(tokens))
        if self.forward and not self.is_cancelled:
            self.runner.send_results([self.request_id] * len(tokens), tokens, [])

    def end(self) -> None:
        self.was_cancelled = self.is_cancelled


class StopWhenCancelled(StoppingCriteria):
    """Ends generation normally (so the store keeps what was computed) once the request is cancelled."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        done = self.progress.is_cancelled
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


def generate_tokens(
    model: Any, processor: Any, inputs: dict[str, Any], generation_kwargs: dict[str, Any], progress: Progress
) -> list[int]:
    """One request's ``generate``, as transformers' `GenerateRunner` calls it, with our streamer and stop."""
    kwargs = dict(generation_kwargs)
    seed = kwargs.pop("seed", None)
    if seed is not None:
        torch.manual_seed(seed)
    model_inputs = {key: value.to(model.device) if hasattr(value, "to") else value for key, value in inputs.items()}
    call = {**model_inputs, **{name: value for name, value in kwargs.items() if value is not None}}
    call.update(tokenizer=processor, streamer=progress)
    call["stopping_criteria"] = StoppingCriteriaList([StopWhenCancelled(progress)])
    if hasattr(model, "has_talker"):
        call["generation_mode"] = "text"  # as transformers' runner: text only
    sequences = model.generate(**call)
    return list(sequences[0, model_inputs["input_ids"].shape[-1] :].tolist())


def run_job(
    model: Any,
    processor: Any,
    ticket: Ticket,
    inputs: dict[str, Any],
    generation_kwargs: dict[str, Any],
    streamer: Any = None,
) -> None:
    """What an API server submits for a generation request: `generate_tokens` in the request's scope (see above),
    or, when the process batches, its row in the loop (`batched.py`)."""
    progress = Progress(streamer, forward=ticket.stream)
    started = now()
    if ticket.deadline is not None and ticket.deadline <= started:
        progress.send(TimedOut(started - ticket.arrival))
        return
    progress.send(Started(started))

    def alone() -> tuple[list[int], int]:  # where it runs in the loop, its deadline counts from then
        with _request(ticket.salt) as request:
            tokens = generate_tokens(model, processor, inputs, _with_deadline(generation_kwargs, ticket), progress)
        return tokens, 0 if request is None else request.cached_tokens

    batching = ENGINE.batching()
    media = None if batching is None else batched.row_inputs(model, inputs)
    if batching is None:
        tokens, cached_tokens = alone()
    elif media is None:
        with batching.job(progress.runner):
            tokens, cached_tokens = batching.run_alone(alone, batched.MEDIA)
    else:
        timeout_s = None if ticket.deadline is None else ticket.deadline - started
        row_request = batched.to_request(model, processor, inputs, generation_kwargs, ticket.salt, timeout_s, media)
        with batching.job(progress.runner):
            row = batching.run_row(row_request, progress)
        if row.error is not None:
            raise row.error
        tokens, cached_tokens = list(row.tokens), row.cached_tokens
    _finish(ticket, inputs, progress, started, cached_tokens, tokens)


def _with_deadline(generation_kwargs: dict[str, Any], ticket: Ticket) -> dict[str, Any]:
    """`generation_kwargs` with the time left before the ticket's deadline as ``max_time`` (at least a moment)."""
    if ticket.deadline is None:
        return generation_kwargs
    left = max(ticket.deadline - now(), 1e-3)
    max_time = generation_kwargs.get("max_time")
    return {**generation_kwargs, "max_time": left if max_time is None else min(left, max_time)}


def _finish(
    ticket: Ticket, inputs: dict[str, Any], progress: Progress, started: float, cached_tokens: int, tokens: list[int]
) -> None:
    """Record a generation job's numbers and send its end (with its tokens when it did not stream)."""
    finished = Finished(
        model=ticket.model_name,
        tenant=ticket.tenant,
        arrival=ticket.arrival,
        started=started,
        first_token_at=progress.first_token_at,
        ended=now(),
        prompt_tokens=int(inputs["input_ids"].shape[-1]),
        cached_tokens=cached_tokens,
        generated_tokens=progress.num_tokens,
        cancelled=progress.was_cancelled,
    )
    ENGINE.jobs.record(finished)
    progress.send(Ended(finished, None if ticket.stream else tokens))


def run_call(
    model: Any, processor: Any, ticket: Ticket, function: Callable[..., Any], args: tuple[Any, ...], streamer: Any
) -> None:
    """Any other function an API server submits (transcription): run in the request's scope; its result sent back."""
    progress = Progress(streamer, forward=ticket.stream)
    started = now()
    if ticket.deadline is not None and ticket.deadline <= started:
        progress.send(TimedOut(started - ticket.arrival))
        return
    progress.send(Started(started))

    def call() -> tuple[Any, int]:
        with _request(ticket.salt) as request:
            result = function(model, processor, *args, **({"streamer": progress} if ticket.stream else {}))
        return result, 0 if request is None else request.cached_tokens

    batching = ENGINE.batching()
    if batching is None:
        result, cached_tokens = call()
    else:
        with batching.job(progress.runner):
            result, cached_tokens = batching.run_alone(call, batched.CALL)
    finished = Finished(
        ticket.model_name, ticket.tenant, ticket.arrival, started, None, now(), 0, cached_tokens, 0, False
    )
    progress.send(Ended(finished, None if ticket.stream else result))


def _request(salt: str | None) -> AbstractContextManager[RequestScope | None]:
    """This process's store's ``request(salt)`` block, where it has a store (None: no store, nothing to count)."""
    store = ENGINE.store
    return nullcontext() if store is None else store.request(salt)


# ------------------------------------------------------------------ the store and its queries
class Channel:
    """Queries of the API servers to one model's process, answered beside generation: one queue in, one out each.

    Args:
        api_servers: how many API servers ask (each reads its own replies queue).
    """

    def __init__(self, api_servers: int = 1) -> None:
        context = multiprocessing.get_context("spawn")
        self.queries: Any = context.Queue()
        self.replies: list[Any] = [context.Queue() for _ in range(api_servers)]


class EngineState:
    """The model's process's own: its model's name and store, its batching options and loop, the jobs' metrics."""

    def __init__(self) -> None:
        self.model_id = ""
        self.store: Any = None
        self.batch: BatchOptions | None = None  # None: one generate at a time
        self.linear_kernels: LinearKernels | None = None  # what `use_onednn_linears` did (None: not asked)
        self.jobs = JobMetrics()
        self._batching: Batching | None = None
        self._lock = threading.Lock()

    def batching(self) -> Batching | None:
        """The loop the jobs hand their rows to (started on first use, over the store now attached), or None where
        the process does not batch (``--no-batch``, or no store)."""
        store, options = self.store, self.batch
        if store is None or options is None:
            return None
        with self._lock:
            current = self._batching
            if current is None or current.store is not store or current.options != options:
                if current is not None:
                    current.stop()
                current = self._batching = Batching(store, options)
            return current

    def answer(self, kind: str, arg: Any) -> Any:
        """A query's answer: ``stats`` (arg: run the integrity check), ``tenant`` (arg: the tenant), ``metrics``."""
        from hf_prefix_cache.frontends.serve.stats import describe, store_metrics

        batching = self._batching
        if kind == "stats":
            if self.store is None:
                return None
            described = describe(self.model_id, self.store, bool(arg))
            if batching is not None:
                described["batching"] = batching.describe()
            if self.linear_kernels is not None:
                described["linear_kernels"] = self.linear_kernels.describe()
            return described
        if kind == "tenant":
            return self.jobs.tenant_view(arg)["models"]
        if kind == "metrics":
            stores = "" if self.store is None else store_metrics(self.model_id, self.store)
            loop = "" if batching is None else batching.metrics(self.model_id)
            return stores + loop + self.jobs.render()
        raise ValueError(f"unknown query {kind!r}")

    def serve(self, channel: Channel) -> None:
        """Answer `channel`'s queries until the process ends (a thread of its own)."""
        while True:
            api_server, query_id, kind, arg = channel.queries.get()
            try:
                reply: Any = self.answer(kind, arg)
            except Exception as exc:  # the query fails, not the process
                logger.exception("query %s failed", kind)
                reply = RuntimeError(f"{type(exc).__name__}: {exc}")
            channel.replies[api_server].put((query_id, reply))

    def save_and_exit(self, *_: Any) -> None:
        """SIGTERM (transformers unloads the model): stop the loop (its rows end cancelled, what they computed stored),
        save a store with a disk tier, so a restart finds it, then exit."""
        store = self.store
        try:
            if self._batching is not None:
                self._batching.stop(timeout=STOP_TIMEOUT_S)
            if store is not None and store.budgets.get("disk"):
                store.save()
        finally:
            os._exit(0)


#: How long SIGTERM waits for the loop's current step (or a job running alone) before saving the store anyway.
STOP_TIMEOUT_S = 30.0
#: This process's state (set up in the model's process by `StoreLoader`; empty in an API server).
ENGINE = EngineState()


class StoreLoader(ModelLoader):
    """transformers' `ModelLoader`; the model it loads in its process gets a store, and answers queries.

    Args:
        store_options: `PrefixCache` keyword arguments (None: no store).
        channel: where the API servers' queries come from (None: none).
        batch: how the process decodes the requests in flight together (None: one at a time; ``$HF_PREFIX_CACHE_BATCH``
            overrides it there, `batched.from_env`).
        cpu_linear: the kernel of the model's float32 CPU linear layers where it has a store
            (`batching.cpu_linear.use_onednn_linears`; ``auto`` times oneDNN against torch's, ``torch`` leaves them).
        **kwargs: `ModelLoader`'s (device, dtype, ...).
    """

    def __init__(
        self,
        store_options: dict[str, Any] | None,
        channel: Channel | None = None,
        batch: BatchOptions | None = None,
        cpu_linear: Choice = "auto",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.store_options = store_options
        self.channel = channel
        self.batch = batch
        self.cpu_linear = cpu_linear

    def for_engine(self, api_servers: int = 1) -> StoreLoader:
        """A copy with a channel of its own, for one more model's process."""
        loader = copy.copy(self)
        loader.channel = Channel(api_servers)
        return loader

    def load_model_and_processor(self, model_id: str, on_progress: Callable[..., Any] | None = None) -> Any:
        """Load the model (in a thread that then exits: `in_passing_thread`), attach its store, start the queries'
        thread, and (in the process's main thread) save the store on SIGTERM."""
        model, processor = in_passing_thread(lambda: self._load(model_id, on_progress))
        if self.channel is not None:
            threading.Thread(target=ENGINE.serve, args=(self.channel,), name="store-queries", daemon=True).start()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, ENGINE.save_and_exit)
        return model, processor

    def _load(self, model_id: str, on_progress: Callable[..., Any] | None) -> Any:
        model, processor = super().load_model_and_processor(model_id, on_progress)
        ENGINE.model_id = model_id
        ENGINE.batch = batched.from_env(self.batch)
        if self.store_options is not None:
            from hf_prefix_cache.api.prefix_cache import PrefixCache

            ENGINE.store = PrefixCache(model, attach="all", **self.store_options)
            logger.info("prefix store attached to %s: budgets %s", model_id, ENGINE.store.budgets)
            ENGINE.linear_kernels = use_onednn_linears(model, self.cpu_linear)
            logger.info("%s: %s", model_id, ENGINE.linear_kernels.describe())
        return model, processor
