"""What an operator's probe of `hf-prefix-cache serve` found, each answered as it must be, on the tiny chat model.

Bodies that answered 500 from inside transformers (a lone surrogate, a ``logit_bias`` past the
vocabulary, an integer bias), a large body that held ``/health`` back while it was parsed and
checked, and a ``cache_salt`` that spelled a tenant's namespace. Then ``--api-server-count 2``:
two API servers share one model's process and its one store.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.serve_server import ServeProcess, tiny_chat_folder

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

NAME = "tiny"
KEYS = {"key-acme": "acme"}
ADMIN = "admin-secret"
CHAT = "/v1/chat/completions"


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


def _post(server: ServeProcess, body: Any, key: str | None = ADMIN, path: str = CHAT) -> Any:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=120)


def _messages(tag: str) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": f"[{tag}] You answer questions for the probes test. " * 4},
        {"role": "user", "content": "Name three colours."},
    ]


def _ask(server: ServeProcess, key: str, messages: list[dict[str, Any]], **fields: Any) -> tuple[str, int, int]:
    response = _post(server, {"model": NAME, "messages": messages, "max_tokens": 4, "temperature": 0, **fields}, key)
    assert response.status_code == 200, response.text
    done = response.json()
    usage = done["usage"]
    return (
        done["choices"][0]["message"]["content"],
        usage["prompt_tokens"],
        usage["prompt_tokens_details"]["cached_tokens"],
    )


def _store(server: ServeProcess) -> dict[str, Any]:
    response = httpx.get(server.url + "/v1/cache/stats?check=true", headers={"Authorization": f"Bearer {ADMIN}"})
    return dict(response.json()["data"][0])


def test_a_lone_surrogate_is_a_400_naming_its_field(server: ServeProcess) -> None:
    """``"hi \\ud800"`` in a message (valid JSON, not valid text) is refused naming the field, not a 500."""
    for endpoint, body, field in (
        (CHAT, {"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages[0].content"),
        ("/v1/completions", {"prompt": "hi \udfff there"}, "prompt"),
    ):
        response = _post(server, {"model": NAME, **body}, path=endpoint)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == field and "surrogate" in error["message"], error
    assert _store(server)["integrity"] == "ok"


def test_logit_bias_past_the_vocabulary_is_a_400_and_an_integer_bias_is_taken(server: ServeProcess) -> None:
    """A token id past the vocabulary is a 400 naming the id and the vocabulary's size; ``{"1000": 5}`` (an integer
    bias, as OpenAI's API takes) answers 200, and biasing a token up to 100 makes the model say it."""
    vocab = 49152  # SmolLM2's tokenizer, which the tiny model uses
    for token_id in (vocab, 10**9, -1):
        response = _post(server, {"model": NAME, "messages": _messages("bias"), "logit_bias": {str(token_id): 1}})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "logit_bias" and str(token_id) in error["message"] and str(vocab) in error["message"]
    fields = {"model": NAME, "messages": _messages("bias"), "max_tokens": 3, "temperature": 0}
    response = _post(server, {**fields, "logit_bias": {"1000": 5}})
    assert response.status_code == 200, response.text
    forced = _post(server, {**fields, "logit_bias": {"1000": 100}})
    assert forced.status_code == 200 and forced.json()["usage"]["completion_tokens"] == 3
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(server.command[4])
    assert forced.json()["choices"][0]["message"]["content"] == tokenizer.decode([1000] * 3, skip_special_tokens=True)


def test_a_forged_salt_spelling_a_tenant_gets_no_hit(server: ServeProcess) -> None:
    """acme's entries are not reachable by a salt that spells acme's namespace, in the old framing or the new."""
    from hf_prefix_cache.frontends.serve.requests import tenant_salt

    messages = _messages("forged")
    cold, prompt_len, _ = _ask(server, "key-acme", messages)
    assert _ask(server, "key-acme", messages)[2] == prompt_len - 1  # acme reuses its own entry
    for forged in (json.dumps(["tenant", "acme", None], separators=(",", ":")), tenant_salt("acme", None)):
        answer, _, cached = _ask(server, ADMIN, messages, cache_salt=forged)
        assert cached == 0 and answer == cold, forged


def test_a_large_body_does_not_hold_health_back(server: ServeProcess) -> None:
    """A 6 MB body (under --max-body-bytes) is read, parsed and checked off the event loop: /health answers fast
    meanwhile, and the body gets its 400."""
    body = {"model": NAME, "messages": [{"role": "user", "content": "w" * 40}] * 100_000, "temperature": -1}
    data = json.dumps(body).encode()
    assert 5_000_000 < len(data) < 32 * 2**20
    answer: dict[str, Any] = {}

    def send() -> None:
        answer["response"] = _post(server, data)

    sender = threading.Thread(target=send)
    sender.start()
    waits = []
    while sender.is_alive():
        start = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        waits.append(time.monotonic() - start)
        time.sleep(0.02)
    sender.join()
    response = answer["response"]
    assert response.status_code == 400 and response.json()["error"]["param"] == "temperature", response.text
    # At least one /health went out while the body was handled (a blocked loop would hold it for seconds); how
    # many fit depends on the machine's load.
    assert waits and max(waits) < 1.0, waits


def test_a_body_that_is_not_a_json_object_is_a_400(server: ServeProcess) -> None:
    """Parsed in a worker thread now, a body that is not JSON, or JSON but not an object, is still refused (400)."""
    for raw in (b"{not json", b'["messages"]', b"\xff\xfe"):
        response = _post(server, raw)
        assert response.status_code == 400 and "JSON" in response.json()["error"]["message"], response.text


# ----------------------------------------------------------------------------- several API servers
@pytest.fixture(scope="module")
def api_servers(folder: str) -> Iterator[ServeProcess]:
    process = ServeProcess(folder, "--api-server-count", "2", "--served-model-name", NAME)
    try:
        yield process.wait()
    finally:
        process.stop()


def test_two_api_servers_share_one_store(api_servers: ServeProcess) -> None:
    """``--api-server-count 2``: every request, whichever API server takes it, reaches the one model process and its
    one store; a conversation's second turn reuses its first, answers equal a cold run (another salt), and the
    store saw every request."""
    stats_before = _store(api_servers)["stats"]["requests"]
    outcomes = []
    for i in range(6):  # new connections each time: the kernel spreads them over both servers
        messages = _messages(f"api servers {i % 2}")
        outcomes.append(_ask(api_servers, "", messages))
    for (answer, prompt_len, cached), i in zip(outcomes, range(6), strict=True):
        if i >= 2:
            assert cached == prompt_len - 1, (i, cached)
        cold, _, cold_cached = _ask(api_servers, "", _messages(f"api servers {i % 2}"), cache_salt=f"cold {i}")
        assert cold_cached == 0 and cold == answer
    store = _store(api_servers)
    assert store["integrity"] == "ok" and store["stats"]["requests"] == stats_before + 12
    text = httpx.get(api_servers.url + "/metrics").text
    assert f'hf_prefix_cache_serve_request_seconds_count{{model="{NAME}",tenant="-"}} 12.0' in text


def _spawned_children(pid: int) -> list[int]:
    """The processes `pid` spawned with multiprocessing (its model's process), read from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid and b"spawn_main" in command:
            found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the model's process through /proc")
def test_the_server_stops_when_its_model_process_dies(folder: str) -> None:
    """A model's process killed (out of memory, a crash) stops the server with exit status 1, as transformers serve
    does, for whatever runs it to restart it."""
    process = ServeProcess(folder, "--served-model-name", NAME, name="serve-engine-dies")
    try:
        process.wait()
        (engine,) = _spawned_children(process.proc.pid)
        os.kill(engine, signal.SIGKILL)
        assert process.proc.wait(timeout=60) == 1, process.tail()
        assert "model's process died" in process.tail()
    finally:
        process.stop()
