"""The model's process decodes the requests in flight together: each job blocks on its row, one loop owns the model.

transformers' `GenerateRunner` sends a request's end when its job function returns, and runs jobs on
its ``_process_requests`` threads. So, when batching is on (the default where the process has a store;
``serve --no-batch`` turns it off), `Batching` keeps one `batching.scheduler.Scheduler` per model's
process, whose thread alone drives the model, and:

- a request's job whose inputs make one row (`row_inputs`: text ids and, on a vision-language model, its
  media; `Batching.run_row`) turns the request into a `batching.rows.Request` (`to_request`), submits it,
  streams each token the loop chooses into the request's token stream (as `engine.Progress.put` does),
  cancels the row at its first token after the API server cancels the request (the row ends before the
  next step, what it computed stored) and blocks until the row ends; the runner then sends the request's
  end, as for any job;
- every other job (several rows, transcription, a function an API server submits) runs through
  `Scheduler.call` (`Batching.run_alone`): alone, between two steps, counted under its
  ``batch_alone:<why>`` reason; a row whose settings the engine lacks carries them as
  ``generate_kwargs`` and the loop runs it alone too (``batch_alone:setting_<name>``);
- runner threads start on demand (`Batching.job`): whenever a job starts and no other thread of the
  runner is idle to take the next one, another ``_process_requests`` thread starts, up to
  `BatchOptions.max_runner_threads` (the server's admitted requests, ``--max-queued`` times its API
  servers, plus one); the runner's stats line (`state`) reports the loop's rows and what waits.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hf_prefix_cache import reasons
from hf_prefix_cache.frontends.serve_args import (
    BATCH_ENV,
    DEFAULT_MAX_BATCH_ROWS,
    DEFAULT_MAX_QUEUED,
    DEFAULT_PREFILL_CHUNK,
)

if TYPE_CHECKING:
    from hf_prefix_cache.batching.rows import Request, Row
    from hf_prefix_cache.batching.scheduler import Scheduler
    from hf_prefix_cache.frontends.serve.engine import Progress

#: The model inputs that are a row's prompt (the others, such as pixel values, go with it as `Request.inputs`).
TEXT_INPUTS = frozenset({"input_ids", "attention_mask"})
#: Fields of a model's generation config that change no token: every other one it sets goes with the row's
#: settings (`batching.settings` applies it per row, or the row runs alone with it), as `generate` applies it.
NEUTRAL_CONFIG = frozenset(
    {
        "max_length",
        "pad_token_id",
        "bos_token_id",
        "decoder_start_token_id",
        "use_cache",
        "cache_implementation",
        "output_attentions",
        "output_hidden_states",
        "output_scores",
        "output_logits",
        "return_dict_in_generate",
        "transformers_version",
        "_from_model_config",
    }
)
#: Why a job whose inputs are more than one row of text ids runs alone.
MEDIA = reasons.with_detail(reasons.BATCH_ALONE, "media")
#: Why a function an API server submits (transcription) runs alone.
CALL = reasons.with_detail(reasons.BATCH_ALONE, "call")


@dataclass(frozen=True, slots=True)
class BatchOptions:
    """How the model's process batches (it crosses to that process inside the pickled `engine.StoreLoader`).

    Attributes:
        max_rows: at most this many rows decode together (``--max-batch-rows``); later arrivals wait for one to leave.
        max_runner_threads: at most this many runner threads (jobs blocked on their rows at once).
        prefill_chunk: prompt tokens a cycle prefills of a row with more uncached ones (``--prefill-chunk``; 0: whole).
        pack_joins: a row joins in the next step's own forward where the model allows it (``--no-pack-joins``: never).
    """

    max_rows: int = DEFAULT_MAX_BATCH_ROWS
    max_runner_threads: int = DEFAULT_MAX_QUEUED + 1
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    pack_joins: bool = True


def from_env(options: BatchOptions | None) -> BatchOptions | None:
    """`options`, unless ``HF_PREFIX_CACHE_BATCH`` says otherwise: ``0`` turns batching off, another value on."""
    value = os.environ.get(BATCH_ENV, "")
    if value == "":
        return options
    return None if value == "0" else options or BatchOptions()


class _Threads:
    """One runner's threads: how many run its ``_process_requests`` loop, how many are in a job now."""

    def __init__(self) -> None:
        self.started = 1  # transformers' own
        self.busy = 0


class Batching:
    """One model's process's batching: its loop over the store, and the runner threads its jobs block in.

    Args:
        store: the model's `PrefixCache`.
        options: its `BatchOptions`.
    """

    def __init__(self, store: Any, options: BatchOptions) -> None:
        from hf_prefix_cache.batching.scheduler import Scheduler

        self.store = store
        self.options = options
        self.scheduler: Scheduler = Scheduler(
            store, max_rows=options.max_rows, prefill_chunk=options.prefill_chunk, pack_joins=options.pack_joins
        )
        self.scheduler.start()
        self._lock = threading.Lock()
        self._runners: dict[int, _Threads] = {}

    @contextmanager
    def job(self, runner: Any) -> Iterator[None]:
        """A job of `runner` runs inside this block; when it starts with no other thread idle, another one starts."""
        with self._lock:
            threads = self._runners.get(id(runner))
            if threads is None:
                threads = self._runners[id(runner)] = _Threads()
                runner.state = lambda: self.state(runner)  # the stats line reports the loop, not one thread's flag
            threads.busy += 1
            if threads.busy >= threads.started and threads.started < self.options.max_runner_threads:
                threads.started += 1
                name = f"generate-{threads.started}"
                threading.Thread(target=runner._process_requests, name=name, daemon=True).start()
        try:
            yield
        finally:
            with self._lock:
                threads.busy -= 1

    def threads(self, runner: Any) -> int:
        """How many threads run `runner`'s jobs (transformers' own included)."""
        with self._lock:
            threads = self._runners.get(id(runner))
            return 1 if threads is None else threads.started

    def state(self, runner: Any) -> tuple[int, int, str]:
        """`GenerateRunner.state` for `runner`: requests running (the batch's rows and one alone), waiting, details."""
        load = self.scheduler.load()
        return load.rows + load.alone, load.waiting + runner.queue.qsize(), f", batch: {load.rows} rows"

    def run_row(self, request: Request, progress: Progress) -> Row:
        """Submit `request`, stream its tokens into `progress`, cancel it with the request; the ended row.

        The row is cancelled at the first token chosen after the request is: a request cancelled while its row
        still waits for the loop ends after its first token, as the sequential path stops its ``generate``, so its
        prompt is prefilled and stored, never dropped.
        """
        from hf_prefix_cache.frontends.serve.metrics import now

        def on_token(row: Row, token: int) -> None:
            if progress.first_token_at is None:
                progress.first_token_at = now()
            progress.num_tokens += 1
            progress.runner.count_tokens(generated=1)
            if progress.is_cancelled:  # it ends before the next step (what it computed is stored)
                row.cancel()
            elif progress.forward:
                progress.runner.send_results([progress.request_id], [token], [])

        row = self.scheduler.submit(request, on_token=on_token)
        row.wait()
        progress.was_cancelled = progress.is_cancelled or row.cancelled
        return row

    def run_alone(self, function: Callable[[], Any], reason: str) -> Any:
        """Run `function` in the loop, alone between two steps, counted under `reason`; what it returns (or raises).

        Raises:
            concurrent.futures.CancelledError: the loop stopped (the process is stopping) before it ran.
        """
        return self.scheduler.call(function, reason).result()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the loop: its rows end cancelled, their work stored (`Scheduler.stop`)."""
        self.scheduler.stop(timeout)

    def describe(self) -> dict[str, int]:
        """The loop's numbers for ``/v1/cache/stats``."""
        load = self.scheduler.load()
        return {**load._asdict(), "max_rows": self.options.max_rows}

    def metrics(self, model_id: str) -> str:
        """The loop's gauges and counters in Prometheus' text format, labelled with `model_id` ("" without
        `prometheus_client`)."""
        try:
            from prometheus_client import CollectorRegistry, generate_latest
            from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        except ImportError:
            return ""
        load = self.scheduler.load()
        p = "hf_prefix_cache_serve_batch"
        families = [
            (GaugeMetricFamily, f"{p}_rows", "rows decoding together now", load.rows),
            (GaugeMetricFamily, f"{p}_waiting", "rows and calls waiting for the loop", load.waiting),
            (CounterMetricFamily, f"{p}_steps", "batched decoding steps", load.steps),
            (CounterMetricFamily, f"{p}_row_steps", "rows decoded by those steps (over steps: mean batch size)",
             load.row_steps),
            (CounterMetricFamily, f"{p}_calls", "jobs run alone in the loop (media, transcription)", load.calls),
            (CounterMetricFamily, f"{p}_prefill_pieces", "prompt pieces prefilled (--prefill-chunk)", load.pieces),
            (CounterMetricFamily, f"{p}_joined_in_step", "requests that joined in a step's own forward",
             load.joined_in_step),
        ]  # fmt: skip

        class Collector:
            def collect(self) -> Iterator[Any]:
                for kind, name, documentation, value in families:
                    family = kind(name, documentation, labels=["model"])
                    family.add_metric([model_id], value)
                    yield family

        registry = CollectorRegistry()
        registry.register(Collector())
        return bytes(generate_latest(registry)).decode("utf-8")


def row_inputs(model: Any, inputs: dict[str, Any]) -> dict[str, Any] | None:
    """The model inputs beside the ids when this request makes one row (its media, if any: the loop decides whether
    it joins the batch, `batching.eligibility`), or None: it runs alone (`MEDIA`), as more than one row of ids, a
    padded row, or a model that generates audio too (run text only, as transformers' runner does)."""
    ids = inputs.get("input_ids")
    if ids is None or getattr(ids, "ndim", 2) != 2 or int(ids.shape[0]) != 1 or hasattr(model, "has_talker"):
        return None
    mask = inputs.get("attention_mask")
    if mask is not None and not bool((mask != 0).all()):
        return None
    return {name: value for name, value in inputs.items() if name not in TEXT_INPUTS}


def to_request(
    model: Any,
    processor: Any,
    inputs: dict[str, Any],
    generation_kwargs: dict[str, Any],
    salt: str | None,
    timeout_s: float | None,
    media: dict[str, Any] | None = None,
) -> Request:
    """The engine's `Request` for one server request: what `generate` would do with `generation_kwargs` on top of
    the model's generation config (`batching.settings.request_from_generate_kwargs`); every setting the engine
    lacks is left to ``generate`` (the row then runs alone, counted)."""
    from hf_prefix_cache.batching.settings import request_from_generate_kwargs

    kwargs = {
        **_config_settings(model),
        **{name: value for name, value in generation_kwargs.items() if value is not None},
    }
    max_time = kwargs.pop("max_time", None)
    if max_time is not None:
        timeout_s = max_time if timeout_s is None else min(timeout_s, max_time)
    kwargs.setdefault("max_new_tokens", 20)  # generate's default, where neither the request nor the model sets one
    request = request_from_generate_kwargs(
        inputs["input_ids"][0].tolist(),
        kwargs,
        tokenizer=getattr(processor, "tokenizer", processor),
        eos_ids=_end_ids(model),
        salt=salt,
        timeout_s=timeout_s,
    )
    return dataclasses.replace(request, inputs=media) if media else request


def _config_settings(model: Any) -> dict[str, Any]:
    """What the model's generation config sets beyond transformers' defaults that may change a token (``generate``
    applies it to every call): such a row runs alone, with it."""
    config = getattr(model, "generation_config", None)
    if config is None:
        return {}
    return {name: value for name, value in config.to_diff_dict().items() if name not in NEUTRAL_CONFIG}


def _end_ids(model: Any) -> list[int]:
    """The model's end ids, as `generate` takes them when the request's kwargs name none."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return [] if eos is None else [eos] if isinstance(eos, int) else [int(e) for e in eos]
