"""Two `hf-prefix-cache serve` processes sharing one `redis-server`: the second hits what the first stored.

Both serve the same saved tiny Llama with ``--remote`` (write-through, 16-token chunks), so the
first server's entries reach Redis as it stores them; the second, which never saw the
conversation, restores whole chunks from Redis and answers exactly as the first did cold. The
first also keeps a disk tier, which is what an unloaded model's store is saved to.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.redis_server import RedisServer
from support.serve_server import ServeProcess, tiny_chat_folder

CHUNK = 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, ServeProcess, ServeProcess, str]]:
    from hf_prefix_cache.api.models import ModelUnavailableError

    try:
        folder = tiny_chat_folder(Path(tmp_path_factory.mktemp("tiny-llama")))
    except ModelUnavailableError as exc:
        pytest.skip(f"the tiny chat model needs SmolLM2's tokenizer: {exc}")
    redis = RedisServer()
    remote = ["--remote", redis.url, "--remote-write", "through", "--remote-chunk-len", str(CHUNK)]
    disk = ["--disk-dir", str(tmp_path_factory.mktemp("disk-tier"))]  # the first server also keeps a disk tier
    first, second = ServeProcess(folder, *remote, *disk), ServeProcess(folder, *remote)
    try:
        yield redis, first.wait(), second.wait(), folder
    finally:
        first.stop()
        second.stop()
        redis.stop()


def test_a_second_server_reuses_what_the_first_stored(
    setup: tuple[RedisServer, ServeProcess, ServeProcess, str],
) -> None:
    """The second server's first request restores whole chunks the first wrote, and answers as the cold first run did."""
    redis, first, second, model = setup
    messages = [
        {"role": "system", "content": "You are a terse assistant for the shared remote tier test. " * 3},
        {"role": "user", "content": "Name three colours."},
    ]

    def ask(server: ServeProcess) -> tuple[str, int, int]:
        response = server.client().chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
        usage = response.usage
        return response.choices[0].message.content, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens

    cold, prompt_len, cached = ask(first)
    assert cached == 0 and first.store()["stats"]["remote_bytes_written"] > 0
    assert redis.client().keys("hfpc:*")
    answer, _, cached = ask(second)
    assert answer == cold
    whole_chunks = prompt_len // CHUNK * CHUNK  # only whole chunks of the prompt are looked up
    assert cached == min(whole_chunks, prompt_len - 1) > 0
    stats = second.store(check=True)
    assert stats["integrity"] == "ok" and stats["stats"]["remote_hits"] == 1


def test_an_unloaded_model_saves_and_drops_its_store_and_a_reload_finds_it_on_disk(
    setup: tuple[RedisServer, ServeProcess, ServeProcess, str],
) -> None:
    """`/reset` unloads the model and its store (saved to the disk tier first); the next request loads both again
    and the new store restores the conversation from disk, not from Redis."""
    _, first, _, model = setup
    messages = [{"role": "user", "content": "Hello again, this is the disk tier test of the serve command."}]

    def ask() -> tuple[int, int]:
        response = first.client().chat.completions.create(model=model, messages=messages, max_tokens=3, temperature=0)
        return response.usage.prompt_tokens, response.usage.prompt_tokens_details.cached_tokens

    ask()
    with urllib.request.urlopen(urllib.request.Request(f"{first.url}/reset", method="POST"), timeout=30) as response:
        assert response.status == 200
    assert first.get("/v1/cache/stats")["data"] == []
    prompt_len, cached = ask()
    assert cached == prompt_len - 1
    store = first.store(check=True)
    assert store["integrity"] == "ok"
    assert store["stats"]["requests"] == 1 and store["stats"]["remote_hits"] == 0 and store["stats"]["reloads"] > 0
