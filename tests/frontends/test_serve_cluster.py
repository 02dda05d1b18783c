"""Two `hf-prefix-cache serve` processes sharing entries through a real three-master Redis Cluster.

Both serve the saved tiny Llama with ``--remote redis+cluster://...`` (write-through, 16-token
chunks): the second, which never saw the conversation, restores whole chunks the first wrote to
the cluster and answers exactly as the first did cold. Then a master is killed: requests whose
chunks live there are misses counted as ``remote_unavailable``, answered exactly, never an error.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.redis_cluster import RedisCluster
from support.serve_server import ServeProcess, tiny_chat_folder

CHUNK = 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisCluster, ServeProcess, ServeProcess, str]]:
    from hf_prefix_cache.api.models import ModelUnavailableError

    try:
        folder = tiny_chat_folder(Path(tmp_path_factory.mktemp("tiny-llama")))
    except ModelUnavailableError as exc:
        pytest.skip(f"the tiny chat model needs SmolLM2's tokenizer: {exc}")
    cluster = RedisCluster()
    remote = ["--remote", cluster.url, "--remote-write", "through", "--remote-chunk-len", str(CHUNK)]
    first, second = ServeProcess(folder, *remote), ServeProcess(folder, *remote)
    try:
        yield cluster, first.wait(), second.wait(), folder
    finally:
        first.stop()
        second.stop()
        cluster.stop()


def _messages(tag: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": f"[{tag}] You are a terse assistant for the shared cluster tier test. " * 3},
        {"role": "user", "content": "Name three colours."},
    ]


def _ask(server: ServeProcess, model: str, messages: list[dict[str, str]]) -> tuple[str, int, int]:
    response = server.client().chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
    usage = response.usage
    return response.choices[0].message.content, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


def test_two_servers_share_entries_through_a_cluster_and_survive_a_killed_master(
    setup: tuple[RedisCluster, ServeProcess, ServeProcess, str],
) -> None:
    """The second server restores the first's whole chunks from the cluster, exactly; with a master killed, a
    conversation with a chunk on it is a counted miss on the second server and still answers exactly."""
    cluster, first, second, model = setup
    tags = [f"conversation {i}" for i in range(6)]
    cold = {tag: _ask(first, model, _messages(tag)) for tag in tags}
    assert all(cached <= 8 for _, _, cached in cold.values())  # the chat template's opening tokens at most
    assert first.store()["stats"]["remote_bytes_written"] > 0

    answer, prompt_len, cached = _ask(second, model, _messages(tags[0]))
    assert answer == cold[tags[0]][0]
    assert cached == min(prompt_len // CHUNK * CHUNK, prompt_len - 1) > 0
    assert second.store()["stats"]["remote_hits"] == 1

    cluster.kill(cluster.ports[1])
    for tag in tags[1:]:
        answer, _, _ = _ask(second, model, _messages(tag))
        assert answer == cold[tag][0]  # exact whether its chunks were reachable or not
        if second.store()["stats"]["fallbacks"].get("remote_unavailable"):
            break
    else:
        pytest.fail("no conversation met the killed master (each spreads its chunks over 3 masters)")
    store = second.store(check=True)
    assert store["integrity"] == "ok" and store["pinned_nodes"] == 0
