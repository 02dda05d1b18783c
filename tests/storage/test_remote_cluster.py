"""The remote tier on a real Redis Cluster (three masters on loopback ports, started here): ``redis+cluster://``.

Chunk keys go to their own slots, so one entry's chunks spread over every master; two stores
(as two processes would) share entries through the cluster exactly; a killed master makes the
requests that need it misses with a counted reason, never an error or a wrong hit.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest import assert_same_as_cold, cached_model, distinct_prompt, generate
from support.redis_cluster import RedisCluster

from hf_prefix_cache import PrefixCache

pytest.importorskip("redis")

CHUNK = 8


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisCluster]:
    started = RedisCluster()
    try:
        yield started
    finally:
        started.stop()


def _store(url: str, **kwargs: object) -> PrefixCache:
    return PrefixCache(cached_model("llama"), remote=url, remote_chunk_len=CHUNK, remote_timeout=1.0, **kwargs)  # type: ignore[arg-type]


def test_two_stores_share_entries_through_a_cluster_and_survive_a_killed_master(cluster: RedisCluster) -> None:
    """A second store hits what the first wrote (exact, every whole chunk), the chunks spread over the masters; with
    one master killed, a prompt with a chunk on it is a miss counted as remote_unavailable and runs exactly cold."""
    model = cached_model("llama")
    writer = _store(cluster.url, remote_write="through")
    prompts = [distinct_prompt(seed, 40) for seed in range(1, 7)]
    for ids in prompts:
        generate(model, ids, past_key_values=writer)
    assert writer.stats().remote_bytes_written > 0 and writer.stats().remote_errors == 0
    client = cluster.client()
    per_master = [len(client.get_node("127.0.0.1", port).redis_connection.keys("hfpc:*")) for port in cluster.ports]  # type: ignore[attr-defined]
    assert all(n > 0 for n in per_master), per_master  # no hash tags: every master holds chunks
    writer.detach()

    reader = _store(cluster.url)
    assert_same_as_cold(model, prompts[0], reader)
    assert (
        reader.stats().remote_hits == 1 and reader.stats().hit_tokens == (40 - 1) // CHUNK * CHUNK
    )  # whole chunks of what a hit may reuse
    reader.detach()

    cluster.kill(cluster.ports[1])
    survivor = _store(cluster.url)
    # Ask stored prompts until one needs the dead master: it must be a miss with the reason, and exact.
    for ids in prompts[1:]:
        assert_same_as_cold(model, ids, survivor)  # exact whether its chunks are reachable or not
        if survivor.stats().fallbacks.get("remote_unavailable"):
            break
    else:
        pytest.fail("no stored prompt met the killed master (each spreads 4 chunks over 3 masters)")
    stats = survivor.stats()
    assert stats.fallbacks.get("remote_unavailable", 0) >= 1 and stats.remote_errors >= 1
    survivor.check_integrity()
    survivor.detach()
