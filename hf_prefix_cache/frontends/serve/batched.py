"""SPIKE (#46, way A): the server's requests decoded together by the batching engine, behind ``--batch``.

transformers' `GenerateRunner` runs one job at a time on its thread and sends a request's end when its
job returns. So, when batching is on (``HF_PREFIX_CACHE_BATCH=1``, set by ``serve --batch``):

- the first job starts `EXTRA_RUNNER_THREADS` more threads running the runner's own ``_process_requests``
  loop, so that up to ``1 + EXTRA_RUNNER_THREADS`` jobs block at once;
- each job (`run_batched`) turns its request into a `batching.rows.Request`, submits it to the process's
  one `Scheduler` (started lazily over the store), streams each token the engine chooses into the
  request's token stream (as `engine.Progress.put` does), cancels the row when the API server cancels
  the request, and blocks until the row ends; the runner then sends the request's end, as today.

Settings the engine does not implement go with the row as ``generate_kwargs``: the scheduler runs such a
row alone through ``generate`` in its own loop (counted as ``batch_alone:setting_<name>``), so the model
is only ever driven from the scheduler's thread. Requests with more than text ids (media) keep today's
path, serialized by `TODAY_LOCK` among themselves (NOT against the scheduler: a spike limit).
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

from hf_prefix_cache.frontends.serve_args import BATCH_ENV

if TYPE_CHECKING:
    from hf_prefix_cache.batching.rows import Request, Row
    from hf_prefix_cache.batching.scheduler import Scheduler
    from hf_prefix_cache.frontends.serve.engine import Progress

#: Runner threads started beside transformers' own one, so that this many more jobs may wait on their rows.
EXTRA_RUNNER_THREADS = 15
#: How often a waiting job looks at its request's cancellation (seconds).
CANCEL_POLL_S = 0.05
#: Keys of the model inputs a batched row may carry (anything else, such as pixel values, runs today's way).
TEXT_INPUTS = frozenset({"input_ids", "attention_mask"})
#: Settings of `generation_kwargs` the batched row reads itself (the others go to ``generate`` alone).
OWN_SETTINGS = frozenset(
    {"max_new_tokens", "eos_token_id", "do_sample", "temperature", "top_k", "top_p", "seed", "max_time"}
)
#: Serializes today's path among the jobs that still take it when batching is on.
TODAY_LOCK = threading.Lock()

_lock = threading.Lock()
_scheduler: Scheduler | None = None
_runners_started: set[int] = set()


def batching_on() -> bool:
    """Whether this process decodes requests together (``HF_PREFIX_CACHE_BATCH=1``)."""
    return os.environ.get(BATCH_ENV, "") not in ("", "0")


def ensure_runner_threads(runner: Any) -> None:
    """Start the extra `_process_requests` threads of `runner` (once per runner)."""
    with _lock:
        if id(runner) in _runners_started:
            return
        _runners_started.add(id(runner))
        for i in range(EXTRA_RUNNER_THREADS):
            threading.Thread(target=runner._process_requests, name=f"generate-{i + 1}", daemon=True).start()


def scheduler(store: Any) -> Scheduler:
    """The process's one scheduler over `store` (started on first use)."""
    global _scheduler
    with _lock:
        if _scheduler is None:
            from hf_prefix_cache.batching.scheduler import Scheduler

            _scheduler = Scheduler(store, max_rows=32)
            _scheduler.start()
        return _scheduler


def can_batch(store: Any, inputs: dict[str, Any]) -> bool:
    """Whether this request goes through the scheduler: a store, one row of text ids."""
    if store is None or not set(inputs) <= TEXT_INPUTS:
        return False
    ids = inputs["input_ids"]
    return getattr(ids, "ndim", 2) == 2 and int(ids.shape[0]) == 1


def to_request(
    model: Any,
    processor: Any,
    inputs: dict[str, Any],
    generation_kwargs: dict[str, Any],
    salt: str | None,
    timeout_s: float | None,
) -> Request:
    """The engine's `Request` for one server request (its settings the engine lacks left to ``generate``)."""
    from hf_prefix_cache.batching.rows import Request
    from hf_prefix_cache.batching.sampling import Sampling

    kwargs = generation_kwargs
    eos = kwargs.get("eos_token_id", model.generation_config.eos_token_id)
    end_ids = frozenset() if eos is None else frozenset([eos] if isinstance(eos, int) else eos)
    if kwargs.get("do_sample"):
        top_k = kwargs.get("top_k") or None
        sampling = Sampling(
            temperature=float(kwargs.get("temperature") or 1.0),
            top_k=top_k,
            top_p=kwargs.get("top_p"),
            seed=kwargs.get("seed"),
        )
    else:
        sampling = Sampling()
    max_time = kwargs.get("max_time")
    if max_time is not None:
        timeout_s = max_time if timeout_s is None else min(timeout_s, max_time)
    extra = {name: value for name, value in kwargs.items() if name not in OWN_SETTINGS and value is not None}
    if "stop_strings" in extra:
        extra["tokenizer"] = processor
    return Request(
        inputs["input_ids"][0].tolist(),
        max_new_tokens=int(kwargs.get("max_new_tokens") or 20),
        sampling=sampling,
        end_ids=end_ids,
        salt=salt,
        timeout_s=timeout_s,
        generate_kwargs=extra,
    )


def run_batched(store: Any, request: Request, progress: Progress) -> Row:
    """Submit `request`, stream its tokens into `progress`, cancel it with the request; return the ended row."""
    from hf_prefix_cache.frontends.serve.metrics import now

    def on_token(row: Row, token: int) -> None:
        if progress.first_token_at is None:
            progress.first_token_at = now()
        progress.num_tokens += 1
        progress.runner.count_tokens(generated=1)
        if progress.forward and not progress.is_cancelled:
            progress.runner.send_results([progress.request_id], [token], [])

    row = scheduler(store).submit(request, on_token=on_token)
    while not row.wait(CANCEL_POLL_S):
        if progress.is_cancelled and not row.cancelled:
            row.cancel()
    progress.was_cancelled = progress.is_cancelled or row.cancelled
    return row
