"""`hf-prefix-cache serve` driven by the real `openai` client, on the real SmolLM2, against `transformers serve`.

One server of ours (a store attached) and one `transformers serve` as shipped (no store) run
for the whole module on free loopback ports. Every answer at temperature 0 must equal the
baseline's; reuse is read from `usage.prompt_tokens_details.cached_tokens` (Responses API:
`input_tokens_details`), and the store's state from ``/v1/cache/stats``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from support.serve_server import ServeProcess

openai = pytest.importorskip("openai")

NEW = 6  # answer tokens per turn


@pytest.fixture(scope="module")
def model_dir() -> str:
    from hf_prefix_cache.api.models import ModelUnavailableError, smollm2_folder

    try:
        return str(smollm2_folder())
    except ModelUnavailableError as exc:
        pytest.skip(f"SmolLM2 is not available here: {exc}")


@pytest.fixture(scope="module")
def servers(model_dir: str) -> Iterator[tuple[ServeProcess, ServeProcess]]:
    ours = ServeProcess(model_dir)
    shipped = ServeProcess(model_dir, ours=False)  # both start at once
    try:
        yield ours.wait(), shipped.wait()
    finally:
        ours.stop()
        shipped.stop()


@pytest.fixture(scope="module")
def model_id(servers: tuple[ServeProcess, ServeProcess], model_dir: str) -> str:
    """The model's path, which both servers take; ours lists it under its folder's name (--served-model-name)."""
    from pathlib import Path

    assert [m.id for m in servers[0].client().models.list().data] == [Path(model_dir).name]
    return model_dir


def _system(tag: str) -> dict[str, str]:
    from hf_prefix_cache.api.sample_text import HANDBOOK

    return {"role": "system", "content": f"[{tag}] You answer questions about this handbook.\n{HANDBOOK[:400]}"}


QUESTIONS = ("Who approves travel?", "And for trips abroad?", "Summarise that in five words.")


def _chat(client: Any, model: str, messages: list[dict[str, Any]], stream: bool, **kwargs: Any) -> tuple[str, Any]:
    """One chat turn at temperature 0: the answer and its usage (streamed: read from the last chunk)."""
    common = {"model": model, "messages": messages, "max_tokens": NEW, "temperature": 0, **kwargs}
    if not stream:
        response = client.chat.completions.create(**common)
        return response.choices[0].message.content, response.usage
    text, usage = [], None
    for chunk in client.chat.completions.create(**common, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    return "".join(text), usage


def _conversation(
    server: ServeProcess, model: str, tag: str, stream: bool, turns: int = 3, **kwargs: Any
) -> list[tuple[str, int, int]]:
    """(answer, prompt_tokens, cached_tokens) of each turn of one conversation."""
    client = server.client()
    messages: list[dict[str, Any]] = [_system(tag)]
    out = []
    for question in QUESTIONS[:turns]:
        messages.append({"role": "user", "content": question})
        answer, usage = _chat(client, model, messages, stream, **kwargs)
        details = usage.prompt_tokens_details
        out.append((answer, usage.prompt_tokens, details.cached_tokens if details is not None else None))
        messages.append({"role": "assistant", "content": answer})
    return out


def _in_parallel(*jobs: Any) -> list[Any]:
    """Run each job (a no-argument callable) in its own thread, so both servers work at once; their results."""
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except BaseException as exc:  # re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("stream", [False, True], ids=["json", "streamed"])
def test_each_turn_reuses_the_previous_one_and_equals_transformers_serve(
    servers: tuple[ServeProcess, ServeProcess], model_id: str, stream: bool
) -> None:
    """Turn k+1 reuses at least turn k's prompt (cached_tokens), and every answer equals transformers serve's."""
    ours, shipped = servers
    tag = f"multi-turn {stream}"
    served, baseline = _in_parallel(
        lambda: _conversation(ours, model_id, tag, stream), lambda: _conversation(shipped, model_id, tag, stream)
    )
    assert [a for a, _, _ in served] == [a for a, _, _ in baseline]
    assert [p for _, p, _ in served] == [p for _, p, _ in baseline]
    assert served[0][2] <= 8  # only the chat template's opening tokens, which every conversation shares
    for (_, prompt_len, _), (_, next_len, cached) in zip(served, served[1:], strict=False):
        assert prompt_len <= cached < next_len, (prompt_len, cached, next_len)
    assert ours.store(check=True)["integrity"] == "ok"


def test_four_concurrent_clients_are_each_exact(servers: tuple[ServeProcess, ServeProcess], model_id: str) -> None:
    """Four clients chatting at once each get transformers serve's answers, and their second turns reuse their first."""
    ours, shipped = servers
    tags = [f"client {i}" for i in range(4)]
    jobs = [
        lambda tag=tag, i=i: _conversation(ours, model_id, tag, stream=i % 2 == 1, turns=2)
        for i, tag in enumerate(tags)
    ]
    jobs += [lambda tag=tag: _conversation(shipped, model_id, tag, stream=False, turns=2) for tag in tags]
    outcomes = _in_parallel(*jobs)  # four clients on our server, the same four on transformers serve
    for tag, served, expected in zip(tags, outcomes[:4], outcomes[4:], strict=True):
        assert [a for a, _, _ in served] == [a for a, _, _ in expected], tag
        (_, first_len, first_cached), (_, _, second_cached) = served
        assert first_cached <= 8 and second_cached >= first_len
    store = ours.store(check=True)
    assert store["integrity"] == "ok" and store["pinned_nodes"] == 0


def _wait_for(condition: Any, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.2)


def test_a_client_disconnecting_mid_stream_releases_its_pins_and_keeps_its_prompt(
    servers: tuple[ServeProcess, ServeProcess], model_id: str
) -> None:
    """A stream closed after three chunks stops generating: its row leaves the batch, no pin stays, and what it
    computed is stored, so the next request with that prompt reuses all of it and answers as transformers serve does."""
    ours, shipped = servers
    client = ours.client()
    messages = [_system("disconnect"), {"role": "user", "content": QUESTIONS[0]}]
    answer, _ = _chat(client, model_id, messages, stream=False)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Tell me a long story."}]
    stream = client.chat.completions.create(
        model=model_id, messages=messages, max_tokens=400, temperature=0, stream=True
    )
    chunks = iter(stream)
    next(chunks), next(chunks), next(chunks)
    assert ours.store()["batching"]["rows"] == 1  # it decodes in the batch (its restored prefix copied, no pin held)
    stream.close()
    _wait_for(lambda: ours.store()["batching"]["rows"] == 0, "the cancelled row to leave the batch")
    _wait_for(lambda: ours.store()["pinned_nodes"] == 0, "the cancelled request to release its pins")
    assert ours.store(check=True)["integrity"] == "ok"
    served, usage = _chat(client, model_id, messages, stream=False)
    assert served == _chat(shipped.client(), model_id, messages, stream=False)[0]
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1  # the cancelled prompt, kept


def test_bad_requests_get_4xx_and_the_store_keeps_everything(
    servers: tuple[ServeProcess, ServeProcess], model_id: str
) -> None:
    """Unknown fields (422), another model (400) and bad salts (400) are refused; the store is unchanged and still hits."""
    ours, _ = servers
    client = ours.client()
    messages = [_system("bad input"), {"role": "user", "content": QUESTIONS[0]}]
    _chat(client, model_id, messages, stream=False)
    before = ours.store()["stats"]
    with pytest.raises(openai.UnprocessableEntityError):
        _chat(client, model_id, messages, stream=False, extra_body={"no_such_field": 1})
    with pytest.raises(openai.BadRequestError):
        _chat(client, "some/other-model", messages, stream=False)
    with pytest.raises(openai.BadRequestError) as bad_salt:
        _chat(client, model_id, messages, stream=False, extra_body={"cache_salt": 5})
    assert "cache_salt must be a non-empty string" in bad_salt.value.response.text
    with pytest.raises(openai.BadRequestError) as two_salts:
        _chat(
            client, model_id, messages, stream=True, extra_body={"cache_salt": "a"}, extra_headers={"x-cache-salt": "b"}
        )
    assert "differ" in two_salts.value.response.text
    after = ours.store(check=True)
    assert after["integrity"] == "ok" and after["pinned_nodes"] == 0
    for name in ("requests", "entries", "nbytes", "hit_tokens"):
        assert after["stats"][name] == before[name], name
    _, usage = _chat(client, model_id, messages, stream=False)
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def test_a_salt_keeps_tenants_apart(servers: tuple[ServeProcess, ServeProcess], model_id: str) -> None:
    """A prompt stored under one salt (body field) is reused by that salt only: not by another (header), nor unsalted."""
    ours, _ = servers
    client = ours.client()
    messages = [_system("tenants"), {"role": "user", "content": QUESTIONS[0]}]

    def cached(**kwargs: Any) -> int:
        return int(_chat(client, model_id, messages, stream=False, **kwargs)[1].prompt_tokens_details.cached_tokens)

    opening = 8  # the chat template's opening tokens, which every unsalted conversation shares
    assert cached(extra_body={"cache_salt": "tenant-a"}) == 0
    assert cached(extra_headers={"x-cache-salt": "tenant-b"}) == 0
    assert cached() <= opening
    assert cached(extra_headers={"x-cache-salt": "tenant-a"}) > 0  # header and field name the same salt
    assert cached(extra_body={"cache_salt": "tenant-b"}) > 0


def test_completions_and_responses_report_cached_tokens(
    servers: tuple[ServeProcess, ServeProcess], model_id: str
) -> None:
    """`/v1/completions` and `/v1/responses` (streamed and not) report reuse and answer as transformers serve does."""
    ours, shipped = servers
    client = ours.client()
    prompt = _system("completions")["content"] + "\nQ: Who approves travel?\nA:"
    texts = []
    for _ in range(2):
        done = client.completions.create(model=model_id, prompt=prompt, max_tokens=NEW, temperature=0)
        texts.append(done.choices[0].text)
    assert done.usage.prompt_tokens_details.cached_tokens == done.usage.prompt_tokens - 1
    baseline = shipped.client().completions.create(model=model_id, prompt=prompt, max_tokens=NEW, temperature=0)
    assert texts == [baseline.choices[0].text] * 2
    question = _system("responses")["content"] + "\nWho approves travel?"
    # transformers' /v1/responses streams unless told not to, so stream=False is sent explicitly.
    first = client.responses.create(model=model_id, input=question, max_output_tokens=NEW, temperature=0, stream=False)
    assert first.usage.input_tokens_details.cached_tokens <= 8  # the chat template's opening tokens
    usage = None
    for event in client.responses.create(
        model=model_id, input=question, max_output_tokens=NEW, temperature=0, stream=True
    ):
        if event.type == "response.completed":
            usage = event.response.usage
    assert usage is not None and usage.input_tokens_details.cached_tokens == usage.input_tokens - 1


def test_stats_and_metrics_endpoints(servers: tuple[ServeProcess, ServeProcess], model_id: str) -> None:
    """`/v1/cache/stats` gives the store's counters as JSON; `/metrics` gives them to Prometheus, labelled by model."""
    ours, _ = servers
    store = ours.store()
    assert store["model"].startswith(model_id.split("@")[0])
    assert store["stats"]["hit_tokens"] > 0 and store["budgets"]["device"] > 0
    pytest.importorskip("prometheus_client")
    text = ours.get("/metrics")
    assert "hf_prefix_cache_hit_tokens_total{" in text and 'model="' in text
