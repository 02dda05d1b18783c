"""Each serve job's limits, on the tiny chat model in this process: deadline, context, and what a cancel keeps.

A request that waits in the queue past its deadline cannot be forced through a live server (the
job ahead always stops at its own deadline first), so these drive `ScopedGenerateManager` as the
handlers do, through `scoped_request`, with a real model and its real `generate`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="hf-prefix-cache serve needs transformers[serving]")

from fastapi import HTTPException  # noqa: E402
from starlette.responses import Response  # noqa: E402

from hf_prefix_cache.frontends.serve.generation import ScopedGenerateManager  # noqa: E402
from hf_prefix_cache.frontends.serve.metrics import ServeMetrics  # noqa: E402
from hf_prefix_cache.frontends.serve.requests import scoped_request  # noqa: E402
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


def _run(
    tiny: tuple[Any, Any], body: dict[str, Any], timeout: float | None, max_new: int | None, stream: bool = False
) -> tuple[Any, ServeMetrics]:
    """One request's job, sent as a handler sends it; its result (or the exception it raised) and the metrics."""
    model, tokenizer = tiny
    metrics = ServeMetrics()
    manager = ScopedGenerateManager(metrics)
    inputs = tokenizer("a b c " * 20, return_tensors="pt")
    config = model.generation_config.__class__(max_new_tokens=max_new, do_sample=False)

    async def handle(_body: dict[str, Any], _id: str) -> Response:
        if stream:
            queue, _ = manager.generate_streaming(model, tokenizer, inputs, config, request_id="r")
            items = []
            while (item := await queue.get()) is not None:
                items.append(item)
                if not isinstance(item, str):
                    break
            return Response(repr(items))
        text, _, generated = await manager.generate_non_streaming(model, tokenizer, inputs, config, request_id="r")
        return Response(str(len(generated)))

    async def main() -> Any:
        try:
            return await scoped_request(handle, body, "r", timeout=timeout)
        except HTTPException as exc:
            return exc

    return asyncio.run(main()), metrics


def test_a_job_past_its_deadline_is_a_503_and_never_runs(tiny: tuple[Any, Any]) -> None:
    """Queued past the deadline: 503 with Retry-After, nothing generated, nothing counted as served."""
    result, metrics = _run(tiny, {}, timeout=-1, max_new=4)
    assert isinstance(result, HTTPException) and result.status_code == 503 and result.headers["Retry-After"] == "1"
    assert "timeout" in result.detail
    deadline = time.monotonic() + 10
    while metrics.running and time.monotonic() < deadline:
        time.sleep(0.05)  # the job leaves just after it hands back its answer
    assert metrics.running == 0 and metrics.queued == 0 and metrics.tenant_view(None)["models"] == {}


def test_a_streamed_job_past_its_deadline_sends_an_error_event(tiny: tuple[Any, Any]) -> None:
    result, _ = _run(tiny, {}, timeout=-1, max_new=4, stream=True)
    assert "_StreamError" in bytes(result.body).decode()


def test_a_job_in_time_stops_at_its_deadline(tiny: tuple[Any, Any]) -> None:
    """A job started in time gets the time left as max_time: 1,900 new tokens asked, far fewer made in 0.3 s."""
    result, metrics = _run(tiny, {}, timeout=0.3, max_new=1900)
    made = int(bytes(result.body))
    assert 0 < made < 1900
    deadline = time.monotonic() + 10
    while not metrics.tenant_view(None)["models"] and time.monotonic() < deadline:
        time.sleep(0.05)  # the job records itself just after it hands back its answer
    served = metrics.tenant_view(None)["models"][""]
    assert served["requests"] == 1 and served["generated_tokens"] == made


def test_the_context_refuses_an_explicit_length_and_clamps_a_default_one(tiny: tuple[Any, Any]) -> None:
    """Over the 2,048-token context: max_tokens named is a 400 with both numbers; a default length is clamped."""
    refused, _ = _run(tiny, {"max_tokens": 2040}, timeout=None, max_new=2040)
    assert isinstance(refused, RequestError) and refused.param == "max_tokens"
    assert (
        "the prompt has 61 tokens" in refused.detail and "2048" in refused.detail and "at most 1987" in refused.detail
    )
    clamped, _ = _run(tiny, {}, timeout=0.2, max_new=5000)
    assert int(bytes(clamped.body)) <= 2048 - 61
