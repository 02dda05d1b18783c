"""`hf-prefix-cache serve` for operators: bad requests are 4xx, keys make tenants, limits, metrics, kept prompts.

One server on the tiny chat model (the model does not matter here: what is checked is how the
server answers), with a keys file (two keys of tenant ``acme``, one of ``globex``) and an admin
key, is shared by the module; a second one with tight limits checks 413 and 429. Reuse is read
from ``cached_tokens`` and compared with a cold run of the same prompt (another tenant's), so
no test here passes with the store off.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.serve_server import ServeProcess, image_url, tiny_chat_folder

openai = pytest.importorskip("openai")

NAME = "tiny"
KEYS = {"key-acme": "acme", "key-acme-2": "acme", "key-globex": "globex"}
ADMIN = "admin-secret"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    from hf_prefix_cache.api.models import ModelUnavailableError

    try:
        return tiny_chat_folder(Path(tmp_path_factory.mktemp("tiny-llama")))
    except ModelUnavailableError as exc:
        pytest.skip(f"the tiny chat model needs SmolLM2's tokenizer: {exc}")


@pytest.fixture(scope="module")
def server(folder: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    process = ServeProcess(folder, "--api-keys-file", str(keys), "--admin-key", ADMIN, "--served-model-name", NAME)
    try:
        yield process.wait()
    finally:
        process.stop()


def _client(server: ServeProcess, key: str) -> Any:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)


def _get(server: ServeProcess, path: str, key: str | None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(server.url + path, headers=headers), timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _store(server: ServeProcess, check: bool = False) -> dict[str, Any]:
    status, text = _get(server, "/v1/cache/stats" + ("?check=true" if check else ""), ADMIN)
    assert status == 200, text
    return dict(json.loads(text)["data"][0])


def _messages(tag: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": f"[{tag}] You answer questions for the operators test. " * 4},
        {"role": "user", "content": "Name three colours."},
    ]


def _ask(client: Any, messages: list[dict[str, Any]], **kwargs: Any) -> tuple[str, int, int]:
    done = client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, temperature=0, **kwargs)
    usage = done.usage
    return done.choices[0].message.content, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


GOOD = [{"role": "user", "content": "hi"}]
# (endpoint, body, the field the 400 must name): the malformed requests and more.
MALFORMED: list[tuple[str, dict[str, Any], str]] = [
    ("chat", {"messages": []}, "messages"),
    ("chat", {}, "messages"),
    ("chat", {"messages": 5}, "messages"),
    ("chat", {"messages": ["hi"]}, "messages[0]"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("chat", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ("chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("chat", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "sound"}]}]}, "messages[0].content[0].type"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "messages[0].content[0].text"),
    ("chat", {"messages": GOOD, "max_tokens": -5}, "max_tokens"),
    ("chat", {"messages": GOOD, "max_tokens": 0}, "max_tokens"),
    ("chat", {"messages": GOOD, "max_tokens": "ten"}, "max_tokens"),
    ("chat", {"messages": GOOD, "max_tokens": 10**9}, "max_tokens"),
    ("chat", {"messages": GOOD, "max_tokens": 2**70}, "max_tokens"),
    ("chat", {"messages": GOOD, "max_completion_tokens": 1.5}, "max_completion_tokens"),
    ("chat", {"messages": GOOD, "temperature": -1}, "temperature"),
    ("chat", {"messages": GOOD, "temperature": 100}, "temperature"),
    ("chat", {"messages": GOOD, "top_p": 5}, "top_p"),
    ("chat", {"messages": GOOD, "frequency_penalty": 9}, "frequency_penalty"),
    ("chat", {"messages": GOOD, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("chat", {"messages": GOOD, "stop": 7}, "stop"),
    ("chat", {"messages": GOOD, "seed": "x"}, "seed"),
    ("chat", {"messages": GOOD, "stream": "yes"}, "stream"),
    ("chat", {"messages": GOOD, "n": 3}, "n"),
    ("chat", {"messages": GOOD, "generation_config": "{not json"}, "generation_config"),
    ("chat", {"messages": GOOD, "generation_config": json.dumps({"num_beams": -1})}, "generation_config.num_beams"),
    ("chat", {"messages": GOOD, "logit_bias": {"x": 1}}, "logit_bias"),
    ("chat", {"messages": GOOD, "cache_salt": "s" * 1_000_000}, "cache_salt"),
    ("chat", {"messages": GOOD, "model": 5}, "model"),
    ("chat", {"messages": GOOD, "model": "some/other-model"}, ""),
    (
        "chat",
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]}
            ]
        },
        "messages[0].content[0].image_url",
    ),
    (
        "chat",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8gd29ybGQ="}}],
                }
            ]
        },
        "messages[0].content[0].image_url",
    ),
    (
        "chat",  # a good image, but this model reads text only: refused, not dropped
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(0)}}]}]},
        "messages[0].content[0].type",
    ),
    (
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "/etc/passwd"}}]}]},
        "messages[0].content[0].image_url",
    ),
    ("completion", {}, "prompt"),
    ("completion", {"prompt": ""}, "prompt"),
    ("completion", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("response", {}, "input"),
    ("response", {"input": "hi", "max_output_tokens": -1}, "max_output_tokens"),
    ("response", {"input": [{"role": "wizard", "content": "hi"}]}, "input[0].role"),
]
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "response": "/v1/responses"}


def _post(server: ServeProcess, path: str, body: Any, key: str | None, headers: dict[str, str] | None = None) -> Any:
    import httpx

    sent = {**({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        server.url + path, content=content, headers={"content-type": "application/json", **sent}, timeout=120
    )


def test_each_malformed_request_is_a_400_naming_its_field_and_the_store_stays_intact(server: ServeProcess) -> None:
    """Every malformed request above gets 400 in OpenAI's error shape naming the field; the store is unchanged after."""
    client = _client(server, "key-acme")
    messages = _messages("malformed")
    _ask(client, messages)
    before = _store(server)["stats"]
    for endpoint, body, field in MALFORMED:
        body = {"model": NAME, **body} if "model" not in body else body
        response = _post(server, PATHS[endpoint], body, "key-acme")
        assert response.status_code == 400, (endpoint, str(body)[:200], response.text[:300])
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
        if field:
            assert error["param"] == field and field in error["message"], (field, error)
    huge_header = _post(
        server, PATHS["chat"], {"model": NAME, "messages": GOOD}, "key-acme", {"x-cache-salt": "h" * 10_000}
    )
    assert huge_header.status_code == 400 and huge_header.json()["error"]["param"] == "cache_salt"
    after = _store(server, check=True)
    assert after["integrity"] == "ok" and after["pinned_nodes"] == 0
    for name in ("requests", "entries", "nbytes", "hit_tokens"):
        assert after["stats"][name] == before[name], name
    _, prompt_len, cached = _ask(client, messages)  # the store still serves
    assert cached == prompt_len - 1


def test_a_prompt_over_the_context_is_refused_before_any_compute_with_both_numbers(server: ServeProcess) -> None:
    """A 2,048-token model given a longer prompt: a 400 naming the prompt's length and the context, in well under a
    second, and no request reaches the store."""
    before = _store(server)["stats"]["requests"]
    long = [{"role": "user", "content": "colour " * 2100}]
    start = time.monotonic()
    with pytest.raises(openai.BadRequestError) as refused:
        _ask(_client(server, "key-acme"), long)
    elapsed = time.monotonic() - start
    message = refused.value.body["message"] if isinstance(refused.value.body, dict) else str(refused.value)
    assert "2048" in message and "the prompt has 2" in message, message
    assert elapsed < 5, elapsed
    with pytest.raises(openai.BadRequestError) as too_many:
        _ask(_client(server, "key-acme"), _messages("context"), extra_body={"max_tokens": 2000})
    assert "2048" in str(too_many.value) and "at most" in str(too_many.value)
    assert _store(server)["stats"]["requests"] == before


def test_keys_are_required_and_tenants_share_only_their_own_entries(server: ServeProcess) -> None:
    """No key or a wrong one: 401. The same tenant reuses through its second key; another tenant reuses nothing,
    even naming the first tenant as its salt, and gets the same answer cold."""
    for key in (None, "wrong"):
        status, text = _get(server, "/v1/models", key)
        assert status == 401 and "API key" in text
    assert _get(server, "/health", None)[0] == 200
    assert [m.id for m in _client(server, "key-acme").models.list().data] == [NAME]
    messages = _messages("tenants")
    cold, prompt_len, cached = _ask(_client(server, "key-acme"), messages)
    assert cached <= 8  # only the chat template's opening tokens, stored by acme's earlier requests
    same, _, cached = _ask(_client(server, "key-acme-2"), messages)
    assert same == cold and cached == prompt_len - 1  # the same tenant through another key
    other, _, cached = _ask(_client(server, "key-globex"), messages, extra_body={"cache_salt": "acme"})
    assert other == cold and cached == 0  # another tenant, even claiming acme's name as its salt
    _, _, cached = _ask(_client(server, "key-globex"), messages, extra_body={"cache_salt": "acme"})
    assert cached == prompt_len - 1  # ... reuses its own entry
    _, _, cached = _ask(_client(server, "key-globex"), messages, extra_body={"cache_salt": "narrower"})
    assert cached == 0  # a salt narrows within the tenant


def test_a_tenant_sees_only_its_own_counters_and_never_the_admin_endpoints(server: ServeProcess) -> None:
    """A tenant's /v1/cache/stats is its own counters; ?check=true, /metrics, /reset and /load_model need the admin."""
    _ask(_client(server, "key-globex"), _messages("own counters"))
    status, text = _get(server, "/v1/cache/stats", "key-globex")
    view = json.loads(text)
    assert status == 200 and view["tenant"] == "globex" and set(view["models"]) == {NAME}
    assert view["models"][NAME]["requests"] >= 1 and "acme" not in text and "stats" not in view
    assert _get(server, "/v1/cache/stats?check=true", "key-globex")[0] == 403
    assert _get(server, "/metrics", "key-globex")[0] == 403
    assert _post(server, "/reset", {}, "key-globex").status_code == 403
    assert _post(server, "/load_model", {"model": "x"}, "key-globex").status_code == 403
    assert _store(server, check=True)["integrity"] == "ok"  # the admin reaches it


def test_metrics_have_latency_histograms_queue_gauges_and_statuses(server: ServeProcess) -> None:
    """/metrics (admin) carries time to first token and end-to-end histograms by model and tenant, the queue gauges,
    tokens per second, requests by status and the reused-token ratio, beside the stores' own counters; every series
    the Grafana dashboard (integrations/grafana) reads is there."""
    client = _client(server, "key-acme")
    messages = _messages("metrics")
    for _ in range(2):
        stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert _post(server, PATHS["chat"], {"model": NAME, "messages": []}, "key-acme").status_code == 400
    assert _get(server, "/v1/models", None)[0] == 401
    status, text = _get(server, "/metrics", ADMIN)
    assert status == 200
    labels = f'model="{NAME}",tenant="acme"'
    for family in (
        "hf_prefix_cache_serve_time_to_first_token_seconds_count",
        "hf_prefix_cache_serve_request_seconds_count",
        "hf_prefix_cache_serve_generated_tokens_per_second_count",
        "hf_prefix_cache_serve_reused_token_ratio",
    ):
        assert f"{family}{{{labels}" in text, family
    assert f'hf_prefix_cache_serve_queue_seconds_count{{model="{NAME}"}}' in text
    assert 'hf_prefix_cache_serve_requests_total{endpoint="/v1/chat/completions",status="400",tenant="acme"}' in text
    assert 'hf_prefix_cache_serve_requests_total{endpoint="other",status="401",tenant="-"}' in text
    assert "hf_prefix_cache_serve_running 0.0" in text and "hf_prefix_cache_serve_queued 0.0" in text
    assert "hf_prefix_cache_hit_tokens_total{" in text  # the store's own
    dashboard = Path(__file__).parents[2] / "integrations" / "grafana" / "hf-prefix-cache-serve.json"
    exprs = [t["expr"] for p in json.loads(dashboard.read_text())["panels"] for t in p["targets"]]
    names = {n for e in exprs for n in re.findall(r"hf_prefix_cache_[a-z_]+", e)}
    assert len(names) >= 12 and not [n for n in names if n not in text]  # the Grafana dashboard reads real series


def test_a_cancelled_stream_keeps_its_prompt(server: ServeProcess) -> None:
    """A stream closed after its first chunks stops generating; its prompt is stored, so the next request with it
    reuses all of it and answers as a cold run does."""
    client = _client(server, "key-acme")
    messages = _messages("cancelled")
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=1500, temperature=0, stream=True)
    chunks = iter(stream)
    next(chunks), next(chunks)
    stream.close()
    answer, prompt_len, cached = _ask(client, messages)
    assert cached >= prompt_len - 1
    cold, _, cold_cached = _ask(_client(server, "key-globex"), messages, extra_body={"cache_salt": "cancelled-cold"})
    assert cold_cached == 0 and answer == cold
    status, text = _get(server, "/metrics", ADMIN)
    assert f'hf_prefix_cache_serve_cancelled_total{{model="{NAME}",tenant="acme"}}' in text
    _wait(lambda: _store(server)["pinned_nodes"] == 0, "pins released")


def _wait(condition: Any, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.2)


def _raw_request(server: ServeProcess, body: dict[str, Any], key: str) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def test_a_client_gone_before_the_first_chunk_frees_its_place_and_keeps_its_prompt(server: ServeProcess) -> None:
    """Two long streams sent on raw sockets and closed unread: both leave the server (admitted and running back to 0)
    and each prompt is reused by the next request."""
    tags = ["gone 0", "gone 1"]
    socks = [
        _raw_request(server, {"model": NAME, "messages": _messages(t), "max_tokens": 1500, "stream": True}, "key-acme")
        for t in tags
    ]
    time.sleep(0.5)
    for sock in socks:
        sock.close()

    def idle() -> bool:
        text = _get(server, "/metrics", ADMIN)[1]
        return "hf_prefix_cache_serve_admitted 0.0" in text and "hf_prefix_cache_serve_running 0.0" in text

    _wait(idle, "the closed requests to leave")
    for tag in tags:
        _, prompt_len, cached = _ask(_client(server, "key-acme"), _messages(tag))
        assert cached >= prompt_len - 1, tag


# ----------------------------------------------------------------------------- limits
@pytest.fixture(scope="module")
def tight(folder: str) -> Iterator[ServeProcess]:
    process = ServeProcess(
        folder, "--max-queued", "1", "--max-body-bytes", "4000", "--request-timeout", "3", "--served-model-name", NAME
    )
    try:
        yield process.wait()
    finally:
        process.stop()


def test_limits_a_large_body_is_413_and_a_full_queue_is_429_with_retry_after(tight: ServeProcess) -> None:
    """A body over --max-body-bytes gets 413; with --max-queued 1 and one stream generating, the next request gets
    429 with Retry-After, and once the stream ends requests are admitted again."""
    big = _post(tight, PATHS["chat"], {"model": NAME, "messages": [{"role": "user", "content": "x" * 5000}]}, None)
    assert big.status_code == 413 and "4000" in big.json()["error"]["message"]
    client = tight.client()
    stream = client.chat.completions.create(
        model=NAME, messages=_messages("queue"), max_tokens=300, temperature=0, stream=True
    )
    chunks = iter(stream)
    next(chunks)
    refused = _post(tight, PATHS["chat"], {"model": NAME, "messages": GOOD, "max_tokens": 2}, None)
    assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
    assert "--max-queued 1" in refused.json()["error"]["message"]
    for _ in chunks:
        pass
    _wait(lambda: "hf_prefix_cache_serve_admitted 0.0" in _get(tight, "/metrics", None)[1], "the stream to leave")
    answer = client.chat.completions.create(model=NAME, messages=GOOD, max_tokens=2, temperature=0)
    assert answer.choices[0].finish_reason in ("length", "stop")


def test_a_request_over_its_timeout_stops_at_the_deadline(tight: ServeProcess) -> None:
    """--request-timeout 3: a long answer ends by its deadline (generate's max_time) instead of running on.

    A quiet machine may write all 1,900 tokens of the tiny model before the deadline; the answer must
    then have come within it. That the job gets the time left as `max_time` is tested deterministically
    in test_serve_queue.py.
    """
    _wait(lambda: "hf_prefix_cache_serve_admitted 0.0" in _get(tight, "/metrics", None)[1], "an empty queue")
    start = time.monotonic()
    done = tight.client().chat.completions.create(
        model=NAME, messages=_messages("timeout"), max_tokens=1900, temperature=0
    )
    elapsed = time.monotonic() - start
    if done.usage.completion_tokens == 1900:
        assert elapsed < 3 + 1.5, f"all 1,900 tokens in {elapsed:.1f} s: the 3 s deadline did not stop it"
    else:
        assert elapsed < 3 + 10, f"stopped, but only after {elapsed:.1f} s"


def test_concurrent_requests_get_no_server_error(tight: ServeProcess) -> None:
    """Many clients at once on a one-place queue: each gets 200 or 429, never a 5xx."""
    statuses: list[int] = []

    def send() -> None:
        statuses.append(
            _post(tight, PATHS["chat"], {"model": NAME, "messages": GOOD, "max_tokens": 2}, None).status_code
        )

    _wait(lambda: "hf_prefix_cache_serve_admitted 0.0" in _get(tight, "/metrics", None)[1], "an empty queue")
    threads = [threading.Thread(target=send) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert set(statuses) <= {200, 429} and 200 in statuses, statuses
