"""Each serve job in the model's process, on the tiny chat model: deadline, context, and what a cancel keeps.

A request that waits in the queue past its deadline cannot be forced through a live server (the
job ahead always stops at its own deadline first), so these submit `engine.run_job` to
transformers' real `GenerateRunner` (the runner of the model's process) in this process, with a
real model and its real `generate`, and read what it sends back as an API server would.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="hf-prefix-cache serve needs transformers[serving]")

from hf_prefix_cache._compat import serve_requirement  # noqa: E402

if serve_requirement() is not None:
    pytest.skip(serve_requirement(), allow_module_level=True)

from transformers.cli.serving.utils import GenerateRunner, _StreamError  # noqa: E402

from hf_prefix_cache.frontends.serve.client import _Job, _ReportingDetokenizer, fit_context  # noqa: E402
from hf_prefix_cache.frontends.serve.engine import Ended, Started, Ticket, TimedOut, run_job  # noqa: E402
from hf_prefix_cache.frontends.serve.metrics import ServeMetrics, now  # noqa: E402
from hf_prefix_cache.frontends.serve.validate import RequestError  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_prefix_cache.api.models import ModelUnavailableError
    from hf_prefix_cache.testing.serve_process import tiny_chat_folder

    try:
        folder = tiny_chat_folder(Path(tmp_path_factory.mktemp("tiny-llama")))
    except ModelUnavailableError as exc:
        pytest.skip(f"the tiny chat model needs SmolLM2's tokenizer: {exc}")
    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


class Sent:
    """What the runner sends an API server: tokens and reports of request 1, then its end."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.ended = threading.Event()
        self.on_token: Any = None

    def __call__(self, ids: list[int], tokens: list[Any], finished: list[Any]) -> None:
        self.items += tokens
        if self.on_token is not None and any(isinstance(t, int) for t in tokens):
            self.on_token()
        if finished:
            self.ended.set()

    def reports(self, kind: type) -> list[Any]:
        return [item for item in self.items if isinstance(item, kind)]


def _submit(
    runner: GenerateRunner, sent: Sent, tokenizer: Any, prompt: str, deadline: float | None, max_new: int, stream: bool
) -> None:
    inputs = dict(tokenizer(prompt, return_tensors="pt"))
    ticket = Ticket(None, None, "tiny", now(), deadline, stream)
    runner.submit(1, run_job, (ticket, inputs, {"max_new_tokens": max_new, "do_sample": False}), True)
    assert sent.ended.wait(120)


def _run(tiny: tuple[Any, Any], deadline: float | None, max_new: int, stream: bool = False) -> Sent:
    model, tokenizer = tiny
    sent = Sent()
    _submit(GenerateRunner(model, tokenizer, sent), sent, tokenizer, "a b c " * 20, deadline, max_new, stream)
    return sent


def test_a_job_past_its_deadline_never_runs_and_its_request_gets_a_timeout(tiny: tuple[Any, Any]) -> None:
    """Queued past the deadline: one `TimedOut`, nothing generated; a streamed request's API side reads an error."""
    sent = _run(tiny, deadline=now() - 1, max_new=4, stream=True)
    assert len(sent.reports(TimedOut)) == 1 and not sent.reports(Started) and not sent.reports(Ended)
    assert not [item for item in sent.items if isinstance(item, int)]

    async def read() -> Any:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        metrics = ServeMetrics()
        streamer = _ReportingDetokenizer(tiny[1]._tokenizer, queue)
        streamer.job = _Job(None, metrics)
        for item in sent.items:
            streamer.put_token(item)
        streamer.job.leave()
        return queue.get_nowait(), metrics

    error, metrics = asyncio.run(read())
    assert isinstance(error, _StreamError) and "timeout" in error.msg
    assert metrics.queued == 0 and metrics.running == 0


def test_a_job_in_time_stops_at_its_deadline(tiny: tuple[Any, Any]) -> None:
    """A job started in time gets the time left as max_time: 1,900 new tokens asked, far fewer made in 0.3 s."""
    sent = _run(tiny, deadline=now() + 0.3, max_new=1900)
    (ended,) = sent.reports(Ended)
    made = len(ended.result)
    assert 0 < made < 1900 and ended.finished.generated_tokens == made and not ended.finished.cancelled


def test_a_cancelled_job_stops_normally_and_its_prompt_is_stored(tiny: tuple[Any, Any]) -> None:
    """Cancelled after its first tokens, a job ends (no error), says it was cancelled, and the store keeps its prompt:
    the same prompt again restores all of it and answers as the model does cold."""
    from hf_prefix_cache import PrefixCache
    from hf_prefix_cache.frontends.serve.engine import ENGINE

    model, tokenizer = tiny
    prompt = "the cancelled prompt " * 10
    cold = Sent()
    _submit(GenerateRunner(model, tokenizer, cold), cold, tokenizer, prompt, None, 6, stream=False)
    store = PrefixCache(model, attach="all")
    ENGINE.store = store  # as `StoreLoader` sets it in the model's process: jobs count their reuse there
    try:
        sent = Sent()
        runner = GenerateRunner(model, tokenizer, sent)
        sent.on_token = lambda: runner.cancel(1)
        _submit(runner, sent, tokenizer, prompt, None, 1500, stream=True)
        (ended,) = sent.reports(Ended)
        assert ended.finished.cancelled and ended.finished.generated_tokens < 1500
        again = Sent()
        _submit(GenerateRunner(model, tokenizer, again), again, tokenizer, prompt, None, 6, stream=False)
        (hit,) = again.reports(Ended)
        assert hit.finished.cached_tokens == hit.finished.prompt_tokens - 1
        assert hit.result == cold.reports(Ended)[0].result
        assert store.stats().computed_tokens > 0 and store.check_integrity() is None
    finally:
        ENGINE.store = None
        store.detach()


def test_the_context_refuses_an_explicit_length_and_clamps_a_default_one(tiny: tuple[Any, Any]) -> None:
    """Over the 2,048-token context: max_tokens named is a 400 with both numbers; a default length is clamped."""
    config = tiny[0].config
    with pytest.raises(RequestError) as refused:
        fit_context(config, 61, {"max_new_tokens": 2040}, "max_tokens")
    assert refused.value.param == "max_tokens"
    assert "the prompt has 61 tokens" in refused.value.detail and "2048" in refused.value.detail
    assert "at most 1987" in refused.value.detail
    kwargs = {"max_new_tokens": 5000}
    fit_context(config, 61, kwargs, None)
    assert kwargs["max_new_tokens"] == 2048 - 61


class ByRequest:
    """What the runner sends, kept per request id (several requests in flight on one runner)."""

    def __init__(self) -> None:
        self.items: dict[int, list[Any]] = {}
        self.ended: dict[int, threading.Event] = {}
        self.lock = threading.Lock()

    def __call__(self, ids: list[int], tokens: list[Any], finished: list[Any]) -> None:
        with self.lock:
            for request_id, token in zip(ids, tokens, strict=True):
                self.items.setdefault(request_id, []).append(token)
            for request_id, _ in finished:
                self.ended.setdefault(request_id, threading.Event()).set()

    def wait(self, request_id: int) -> Ended:
        with self.lock:
            event = self.ended.setdefault(request_id, threading.Event())
        assert event.wait(120)
        (ended,) = [item for item in self.items.get(request_id, []) if isinstance(item, Ended)]
        return ended


@pytest.fixture
def batching(tiny: tuple[Any, Any]) -> Any:
    """The model's process's state with a store and batching on, as `StoreLoader` sets it; the loop stopped after."""
    from hf_prefix_cache import PrefixCache
    from hf_prefix_cache.frontends.serve.batched import BatchOptions
    from hf_prefix_cache.frontends.serve.engine import ENGINE

    store = PrefixCache(tiny[0], attach="all")
    ENGINE.store, ENGINE.batch = store, BatchOptions(max_rows=8, max_runner_threads=4)
    try:
        yield store
    finally:
        loop = ENGINE.batching()
        assert loop is not None
        loop.stop()
        ENGINE.store, ENGINE.batch = None, None
        store.detach()


def test_batched_jobs_block_on_their_rows_on_threads_started_on_demand(tiny: tuple[Any, Any], batching: Any) -> None:
    """Three jobs submitted at once to one runner run together (a thread each, and one idle: 4, the bound); each
    answers as it does alone and cold, with its numbers right; the stats line counts the loop's rows."""
    from hf_prefix_cache.frontends.serve.engine import ENGINE

    model, tokenizer = tiny
    prompts = [f"prompt number {i} " * (4 + 3 * i) for i in range(3)]
    cold = []
    for prompt in prompts:
        sent = Sent()
        ENGINE.batch, kept = None, ENGINE.batch  # one at a time, no store: the reference
        ENGINE.store, store = None, ENGINE.store
        _submit(GenerateRunner(model, tokenizer, sent), sent, tokenizer, prompt, None, 6, stream=False)
        ENGINE.batch, ENGINE.store = kept, store
        cold.append(sent.reports(Ended)[0].result)
    sent_by = ByRequest()
    runner = GenerateRunner(model, tokenizer, sent_by)
    for request_id, prompt in enumerate(prompts, start=1):
        inputs = dict(tokenizer(prompt, return_tensors="pt"))
        ticket = Ticket(None, None, "tiny", now(), None, False)
        runner.submit(request_id, run_job, (ticket, inputs, {"max_new_tokens": 6, "do_sample": False}), True)
    ended = [sent_by.wait(request_id) for request_id in (1, 2, 3)]
    assert [e.result for e in ended] == cold
    for e in ended:
        f = e.finished
        assert f.generated_tokens == 6 and f.first_token_at is not None and f.started <= f.first_token_at <= f.ended
    loop = ENGINE.batching()
    assert loop is not None and loop.threads(runner) == 4
    assert runner.state()[:2] == (0, 0) and loop.scheduler.load().row_steps > loop.scheduler.load().steps


def test_a_batched_job_stops_at_its_deadline_and_a_cancelled_one_keeps_its_prompt(
    tiny: tuple[Any, Any], batching: Any
) -> None:
    """The ticket's deadline is the row's timeout; a cancel ends the row at the next step, its prompt stored: the same
    prompt again restores all of it, and no job ran alone."""
    model, tokenizer = tiny
    sent = Sent()
    _submit(GenerateRunner(model, tokenizer, sent), sent, tokenizer, "a b c " * 20, now() + 0.3, 1900, stream=False)
    (ended,) = sent.reports(Ended)
    assert 0 < len(ended.result) < 1900 and ended.finished.generated_tokens == len(ended.result)
    prompt = "the cancelled prompt " * 10
    cancelled = Sent()
    runner = GenerateRunner(model, tokenizer, cancelled)
    cancelled.on_token = lambda: runner.cancel(1)
    _submit(runner, cancelled, tokenizer, prompt, None, 1500, stream=True)
    (stopped,) = cancelled.reports(Ended)
    assert stopped.finished.cancelled and stopped.finished.generated_tokens < 1500
    again = Sent()
    _submit(GenerateRunner(model, tokenizer, again), again, tokenizer, prompt, None, 6, stream=False)
    (hit,) = again.reports(Ended)
    assert hit.finished.cached_tokens == hit.finished.prompt_tokens - 1
    assert batching.stats().fallbacks == {} and batching.check_integrity() is None


def test_a_request_cancelled_while_its_row_waits_still_stores_its_prompt(tiny: tuple[Any, Any], batching: Any) -> None:
    """One row at a time: the second request, cancelled while it waits behind the first, is prefilled once the first
    leaves and ends after one token, cancelled, its prompt stored (as the sequential path stops after one token)."""
    from hf_prefix_cache.frontends.serve.batched import BatchOptions
    from hf_prefix_cache.frontends.serve.engine import ENGINE

    model, tokenizer = tiny
    ENGINE.batch = BatchOptions(max_rows=1, max_runner_threads=4)
    sent = ByRequest()
    runner = GenerateRunner(model, tokenizer, sent)
    prompts = ["the first, long request " * 6, "the waiting request " * 8]
    for request_id, (prompt, new) in enumerate(zip(prompts, (1500, 6), strict=True), start=1):
        inputs = dict(tokenizer(prompt, return_tensors="pt"))
        ticket = Ticket(None, None, "tiny", now(), None, False)
        runner.submit(request_id, run_job, (ticket, inputs, {"max_new_tokens": new, "do_sample": False}), True)
    loop = ENGINE.batching()
    assert loop is not None
    while loop.scheduler.load().waiting == 0:  # the second row waits behind the first
        threading.Event().wait(0.01)
    runner.cancel(2)
    threading.Event().wait(0.3)
    runner.cancel(1)
    first, second = sent.wait(1), sent.wait(2)
    assert first.finished.cancelled and second.finished.cancelled and second.finished.generated_tokens == 1
    again = Sent()
    _submit(GenerateRunner(model, tokenizer, again), again, tokenizer, prompts[1], None, 6, stream=False)
    (hit,) = again.reports(Ended)
    assert hit.finished.cached_tokens == hit.finished.prompt_tokens - 1


def test_sigterm_stops_the_loop_then_saves_its_rows_work(
    tiny: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM (`save_and_exit`) with a row in flight: the row ends cancelled, what it computed is stored, then the
    store is saved: a new store on the same disk folder restores the prompt and every token fed."""
    import torch

    from hf_prefix_cache import PrefixCache
    from hf_prefix_cache.frontends.serve import engine
    from hf_prefix_cache.frontends.serve.batched import BatchOptions

    model, tokenizer = tiny
    store = PrefixCache(model, attach="all", disk_dir=tmp_path, save_on_exit=False)
    assert store.budgets.get("disk")
    engine.ENGINE.store, engine.ENGINE.batch = store, BatchOptions()
    exits: list[int] = []
    monkeypatch.setattr(engine.os, "_exit", exits.append)
    inputs = dict(tokenizer("the prompt of a server told to stop " * 5, return_tensors="pt"))
    try:
        sent = Sent()
        streaming = threading.Event()
        sent.on_token = streaming.set
        ticket = Ticket(None, None, "tiny", now(), None, True)
        GenerateRunner(model, tokenizer, sent).submit(
            1, run_job, (ticket, inputs, {"max_new_tokens": 1500, "do_sample": False}), True
        )
        assert streaming.wait(120)
        engine.ENGINE.save_and_exit()
        assert exits == [0] and sent.ended.wait(120)
        (ended,) = sent.reports(Ended)
        made = [item for item in sent.items if isinstance(item, int)]
        assert ended.finished.cancelled and 0 < len(made) == ended.finished.generated_tokens < 1500
    finally:
        engine.ENGINE.store, engine.ENGINE.batch = None, None
        store.detach()
    fresh = PrefixCache(model, disk_dir=tmp_path, save_on_exit=False)
    try:
        prompt = inputs["input_ids"][0].tolist()
        ids = torch.tensor([[*prompt, *made, 7]])
        with fresh.request() as scope:
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, cache=fresh)
        assert scope.cached_tokens == len(prompt) + len(made) - 1
    finally:
        fresh.detach()
