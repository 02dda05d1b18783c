"""The remote tier against a real `redis-server`: shared hits are exact, faults lose nothing.

Each test starts its own server on a free loopback port (no persistence) and stops it. Stored
prefixes travel in chunks of 8 tokens, so tiny prompts span several chunks. Every cached run is
compared with a cold run (equal tokens, logits within 1e-4).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import LOGIT_TOL, assert_same_as_cold, cached_model, distinct_prompt, generate, max_logit_diff
from support.redis_server import RedisServer
from support.remote_worker import CHUNK, FAMILIES, NEW, extra, first_prompt, model_of

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.model.runs import Run
from hf_prefix_cache.storage.codec import Layout
from hf_prefix_cache.storage.remote import RemoteTier, RemoteUnavailableError, chunk_keys, redact
from hf_prefix_cache.storage.segments import Segment
from hf_prefix_cache.storage.tier import Standalone
from hf_prefix_cache.testing.tiny_models import build

pytest.importorskip("redis")


@pytest.fixture
def server() -> Iterator[RedisServer]:
    srv = RedisServer()
    yield srv
    srv.stop()


def _store(model: Any, url: str, **kwargs: Any) -> PrefixCache:
    return PrefixCache(model, remote=url, remote_chunk_len=CHUNK, **kwargs)


def _fresh(model: Any, url: str, **kwargs: Any) -> PrefixCache:
    """A store with nothing local, as in a new process: every hit must come from the server."""
    return _store(model, url, **kwargs)


def _keys(server: RedisServer) -> list[bytes]:
    return sorted(server.client().keys("hfpc:*"))


def test_chunk_keys_chain_over_the_whole_prefix() -> None:
    """A chunk's key depends on its namespace, its own symbols and every symbol before it."""
    base = list(range(24))
    keys = chunk_keys("ns", base, 8, 3)
    assert len(set(keys)) == 3 and all(k.startswith("hfpc:c1:ns:") for k in keys)
    changed_first = chunk_keys("ns", [99, *base[1:]], 8, 3)
    assert all(a != b for a, b in zip(keys, changed_first, strict=True))  # the change reaches every later chunk
    changed_last = chunk_keys("ns", [*base[:20], 99, *base[21:]], 8, 3)
    assert changed_last[:2] == keys[:2] and changed_last[2] != keys[2]
    assert chunk_keys("other", base, 8, 3)[0] != keys[0]
    media = [-(2**150), *base[1:]]  # media symbols exceed 64 bits
    assert chunk_keys("ns", media, 8, 1) != chunk_keys("ns", [-(2**150) + 1, *base[1:]], 8, 1)


def test_a_second_process_reuses_what_the_first_stored(server: RedisServer) -> None:
    """Text, hybrid recurrent and cross-attention VLM entries written here are exact hits in another process."""
    stored = {}
    for family in FAMILIES:
        model = model_of(family)
        store = _store(model, server.url, remote_write="through", **{"snapshot_interval": CHUNK})
        ids = first_prompt(family)
        out = generate(model, ids, NEW, past_key_values=store, **extra(family, ids))
        assert store.stats().remote_bytes_written > 0
        store.detach()
        stored[family] = out.sequences.tolist()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    worker = Path(__file__).parents[1] / "support" / "remote_worker.py"
    proc = subprocess.run(
        [sys.executable, str(worker), server.url, json.dumps(stored)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for family, got in results.items():
        assert got["equal"] and got["diff"] < LOGIT_TOL, (family, got)
        stored_len = len(stored[family][0]) - 1  # the last generated token is never fed, so never stored
        whole_chunks = stored_len // CHUNK * CHUNK
        assert got["remote_hit_tokens"] == got["hit_tokens"] > 0, (family, got)
        if family == "bamba":  # only up to the last chunk whose end carries a snapshot
            assert got["hit_tokens"] % CHUNK == 0 and got["hit_tokens"] <= whole_chunks, got
        else:
            assert got["hit_tokens"] == whole_chunks, (family, got)


def test_entry_leaving_the_last_local_tier_is_written_and_found_again(server: RedisServer) -> None:
    """With write-back, an entry evicted from a full device tier reaches the server, and a fresh store hits it."""
    model = cached_model("llama")
    one_entry = 45 * 512  # a 45-token entry of the tiny Llama
    store = _store(model, server.url, max_bytes=one_entry)
    a, b = distinct_prompt(1, 40), distinct_prompt(2, 40)
    generate(model, a, past_key_values=store)
    assert store.stats().remote_bytes_written == 0  # still local
    generate(model, b, past_key_values=store)  # evicts a's entry
    assert store.stats().evictions >= 1 and store.stats().remote_bytes_written > 0
    store.detach()
    fresh = _fresh(model, server.url)
    assert_same_as_cold(model, a, fresh)
    assert fresh.stats().hit_tokens == 32 and fresh.stats().remote_hits == 1
    fresh.check_integrity()
    fresh.detach()


def test_entry_dropped_by_max_entries_is_written(server: RedisServer) -> None:
    """An entry dropped to keep `max_entries` also leaves the last local tier, so it is written too."""
    model = cached_model("llama")
    store = _store(model, server.url, max_entries=1)
    a, b = distinct_prompt(1, 40), distinct_prompt(2, 40)
    generate(model, a, past_key_values=store)
    generate(model, b, past_key_values=store)
    assert store.stats().evictions == 1 and len(_keys(server)) == 5
    store.detach()
    fresh = _fresh(model, server.url)
    assert_same_as_cold(model, a, fresh)
    assert fresh.stats().remote_hit_tokens == 32
    fresh.detach()


def test_entry_leaving_the_disk_tier_is_read_from_its_file_and_written(server: RedisServer, tmp_path: Path) -> None:
    """Below a disk tier, an entry dropped from disk is written from its file, then hits exactly elsewhere."""
    model = cached_model("llama")
    one_entry = 45 * 512
    store = _store(model, server.url, max_bytes=one_entry, disk_dir=tmp_path, max_disk_bytes=one_entry)
    prompts = [distinct_prompt(seed, 40) for seed in (1, 2, 3)]
    for ids in prompts:
        generate(model, ids, past_key_values=store)
    assert store.stats().evictions >= 1 and store.stats().remote_bytes_written > 0
    store.check_integrity()
    store.detach()
    fresh = _fresh(model, server.url)
    assert_same_as_cold(model, prompts[0], fresh)
    assert fresh.stats().remote_hit_tokens == 32
    fresh.detach()


def test_local_hit_extended_by_remote_chunks_past_it(server: RedisServer) -> None:
    """A store holding a short prefix locally loads only the chunks past it, and restores both exactly."""
    model = cached_model("llama")
    writer = _store(model, server.url, remote_write="through")
    long = distinct_prompt(5, 40)
    generate(model, long, past_key_values=writer)
    writer.detach()
    reader = _fresh(model, server.url)
    generate(model, long[:, :12], past_key_values=reader)  # its answer differs from `long`: 12 tokens match
    reader.reset_stats()
    assert_same_as_cold(model, long, reader)
    stats = reader.stats()
    assert stats.hit_tokens == 32 and stats.remote_hit_tokens == 24  # chunks 1-3; chunk 0 is local
    reader.check_integrity()
    reader.detach()


def test_server_lru_eviction_shrinks_hits_and_nothing_is_wrong(server: RedisServer) -> None:
    """Under `maxmemory` with `allkeys-lru` the server evicts chunks: hits stop at the first evicted one, all exact.

    Redis keeps last-use times to the second, so which chunks written within one second survive is
    random; each hit is checked against the chunks the server still held just before it.
    """
    client = server.client()
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", str(used + 400_000))  # room for about 70 of the 192 chunks written below
    client.config_set("maxmemory-policy", "allkeys-lru")
    model = cached_model("llama")
    writer = _store(model, server.url, remote_write="through")
    prompts = [distinct_prompt(seed, 64) for seed in range(24)]  # 24 entries x 8 chunks of ~5 KB
    for ids in prompts:
        generate(model, ids, 1, past_key_values=writer)
    writer.detach()
    assert client.info("stats")["evicted_keys"] > 0
    reader = _fresh(model, server.url)
    hits = []
    for ids in prompts:
        keys = chunk_keys(reader._store.namespace(), ids[0].tolist(), CHUNK, 7)  # a 64-token prompt restores 7 chunks
        held = next((i for i, key in enumerate(keys) if not client.exists(key)), len(keys)) * CHUNK
        before = reader.stats().hit_tokens
        assert_same_as_cold(model, ids, reader, new=2)
        hits.append(reader.stats().hit_tokens - before)
        assert hits[-1] % CHUNK == 0 and hits[-1] <= held, (hits[-1], held)
    assert 0 < sum(hits) < 24 * 56, hits  # some chunks served, some evicted
    reader.check_integrity()
    reader.detach()


def test_threads_load_from_the_server_at_once(server: RedisServer) -> None:
    """Four threads generating through one store fetch, adopt and write chunks at once; each equals its cold run."""
    model = cached_model("llama")
    prompts = [distinct_prompt(seed, 40) for seed in range(8)]
    writer = _store(model, server.url, remote_write="through")
    for ids in prompts[:4]:
        generate(model, ids, past_key_values=writer)
    writer.detach()
    colds = [generate(model, ids) for ids in prompts]
    reader = _fresh(model, server.url, remote_write="through")
    results: dict[int, Any] = {}

    def work(i: int) -> None:
        results[i] = generate(model, prompts[i], past_key_values=reader)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, cold in enumerate(colds):
        assert torch.equal(results[i].sequences, cold.sequences), i
        assert max_logit_diff(results[i], cold) < LOGIT_TOL, i
    assert reader.stats().remote_hit_tokens == 4 * 32  # the first four came from the server
    assert len(_keys(server)) == 8 * 5  # the other four were written through
    reader.check_integrity()
    reader.detach()


def test_server_killed_mid_run_falls_back_then_reconnects(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A killed server: requests stay exact on local tiers with a named reason and one WARNING; a restart is picked up."""
    model = cached_model("llama")
    store = _store(model, server.url, remote_write="through")
    generate(model, distinct_prompt(1, 40), past_key_values=store)
    server.kill()
    with caplog.at_level(logging.INFO, logger="hf_prefix_cache"):
        for seed in (2, 3):
            assert_same_as_cold(model, distinct_prompt(seed, 40), store)
        assert_same_as_cold(model, distinct_prompt(1, 40), store)  # still served from the local tier
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "unreachable" in r.getMessage()]
    assert len(warnings) == 1
    stats = store.stats()
    assert stats.fallbacks.get("remote_unavailable", 0) >= 1 and stats.remote_errors >= 1
    assert stats.hit_tokens == 39
    server.start()  # empty, same port
    time.sleep(1.2)  # past the first back-off
    generate(model, distinct_prompt(4, 40), past_key_values=store)
    assert len(_keys(server)) == 5  # the new entry's 45 tokens: 5 whole chunks written again
    store.detach()


def test_hung_server_is_bounded_by_the_timeout(server: RedisServer) -> None:
    """A server that stops answering costs one timeout: the request runs exactly on local tiers."""
    model = cached_model("llama")
    store = _store(model, server.url, remote_timeout=0.3)
    server.pause()
    try:
        assert_same_as_cold(model, distinct_prompt(7, 40), store)
        assert store.stats().fallbacks.get("remote_unavailable") == 1
    finally:
        server.resume()
    store.detach()


def test_tenants_with_different_salts_never_share_a_chunk(server: RedisServer) -> None:
    """Two salts on one server write disjoint keys and neither hits the other's chunks; the same salt does."""
    model = cached_model("llama")
    ids = distinct_prompt(3, 40)
    alice = _store(model, server.url, salt="alice", remote_write="through")
    generate(model, ids, past_key_values=alice)
    alice.detach()
    alice_keys = set(_keys(server))
    bob = _fresh(model, server.url, salt="bob", remote_write="through")
    assert_same_as_cold(model, ids, bob)
    assert bob.stats().hit_tokens == 0 and bob.stats().remote_bytes_read == 0
    bob.detach()
    assert alice_keys.isdisjoint(set(_keys(server)) - alice_keys) and len(_keys(server)) == 10
    alice_again = _fresh(model, server.url, salt="alice")
    assert_same_as_cold(model, ids, alice_again)
    assert alice_again.stats().remote_hit_tokens == 32
    alice_again.detach()


@pytest.mark.parametrize("damage", ["garbage", "truncated", "bit_flip"])
def test_corrupt_chunk_is_dropped_and_the_hit_stops_before_it(
    server: RedisServer, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A damaged value is deleted with a warning; the hit ends at the chunk before it and stays exact."""
    model = cached_model("llama")
    ids = distinct_prompt(4, 40)
    writer = _store(model, server.url, remote_write="through")
    generate(model, ids, past_key_values=writer)
    writer.detach()
    key = chunk_keys(writer._store.namespace(), ids[0].tolist(), CHUNK, 3)[2]
    client = server.client()
    blob = client.get(key)
    bad = {
        "garbage": b"not a safetensors value",
        "truncated": blob[: len(blob) - 100],
        "bit_flip": blob[:-1] + bytes([blob[-1] ^ 1]),
    }[damage]
    client.set(key, bad)
    reader = _fresh(model, server.url)
    with caplog.at_level(logging.WARNING, logger="hf_prefix_cache"):
        assert_same_as_cold(model, ids, reader)
    assert reader.stats().hit_tokens == 16 and reader.stats().remote_errors == 1
    assert any("dropping remote prefix-cache chunk" in r.getMessage() for r in caplog.records)
    assert client.exists(key) == 0
    reader.detach()


def test_foreign_value_under_a_key_is_a_miss_not_a_wrong_hit(server: RedisServer) -> None:
    """A valid chunk of another sequence stored under this sequence's key is never used."""
    model = cached_model("llama")
    ids, other = distinct_prompt(5, 40), distinct_prompt(6, 40)
    writer = _store(model, server.url, remote_write="through")
    generate(model, ids, past_key_values=writer)
    generate(model, other, past_key_values=writer)
    writer.detach()
    ns = writer._store.namespace()
    client = server.client()
    own = chunk_keys(ns, ids[0].tolist(), CHUNK, 2)
    foreign = chunk_keys(ns, other[0].tolist(), CHUNK, 2)
    client.set(own[1], client.get(foreign[1]))  # as if a hash collision put it there
    reader = _fresh(model, server.url)
    assert_same_as_cold(model, ids, reader)
    assert reader.stats().hit_tokens == 8 and reader.stats().remote_errors == 1
    assert client.exists(own[1]) == 1  # valid for its own sequence: left alone
    reader.detach()


def test_full_server_skips_and_counts_writes(server: RedisServer) -> None:
    """A server out of memory with `noeviction` refuses writes: they are skipped, counted, and nothing breaks."""
    client = server.client()
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", str(used + 1024))
    model = cached_model("llama")
    store = _store(model, server.url, remote_write="through")
    assert_same_as_cold(model, distinct_prompt(8, 40), store)
    stats = store.stats()
    assert stats.remote_skipped_writes == 5 and stats.remote_bytes_written == 0
    assert_same_as_cold(model, distinct_prompt(8, 40), store)  # the local tier still serves it
    assert store.stats().hit_tokens == 39
    store.detach()


def test_remote_ttl_sets_an_expiry_on_every_chunk(server: RedisServer) -> None:
    """With `remote_ttl` every written chunk expires on the server after that many seconds; without it, never."""
    model = cached_model("llama")
    for seed, ttl in ((1, 60.0), (2, None)):
        store = _store(model, server.url, remote_write="through", remote_ttl=ttl)
        generate(model, distinct_prompt(seed, 40), past_key_values=store)
        store.detach()
    client = server.client()
    expiries = sorted(client.pttl(key) for key in _keys(server))
    assert len(expiries) == 10
    assert expiries[:5] == [-1] * 5 and all(50_000 < ms <= 60_000 for ms in expiries[5:]), expiries


def test_max_remote_bytes_skips_larger_entries(server: RedisServer) -> None:
    """An entry whose missing chunks exceed `max_remote_bytes` is not written; smaller ones are."""
    model = cached_model("llama")
    chunk_nbytes = CHUNK * 512
    store = _store(model, server.url, remote_write="through", max_remote_bytes=3 * chunk_nbytes)
    generate(model, distinct_prompt(1, 40), past_key_values=store)  # 5 chunks: over
    assert store.stats().remote_skipped_writes == 5 and not _keys(server)
    generate(model, distinct_prompt(2, 20), past_key_values=store)  # 3 chunks: fits
    assert len(_keys(server)) == 3
    store.detach()


def test_recurrent_hits_end_at_the_last_chunk_with_a_snapshot(server: RedisServer) -> None:
    """A hybrid model's remote hit stops at the last chunk carrying its end snapshot (none without snapshots)."""
    model = cached_model("bamba")
    ids = distinct_prompt(9, 30)
    writer = _store(model, server.url, remote_write="through", snapshot_interval=16)
    generate(model, ids, past_key_values=writer)
    writer.detach()
    reader = _fresh(model, server.url, snapshot_interval=16)
    assert_same_as_cold(model, ids, reader)
    assert reader.stats().hit_tokens == 16  # chunk ends 8 and 24 carry no snapshot; 16 does
    reader.check_integrity()
    reader.detach()


def test_password_url_works_and_is_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    """AUTH through the URL; a wrong password only costs the remote tier, and no log line shows a password."""
    server = RedisServer(password="s3cret-pw")
    try:
        model = cached_model("llama")
        ids = distinct_prompt(10, 40)
        with caplog.at_level(logging.DEBUG, logger="hf_prefix_cache"):
            writer = _store(model, server.url, remote_write="through")
            generate(model, ids, past_key_values=writer)
            writer.detach()
            wrong = _fresh(model, server.url.replace("s3cret-pw", "wrong-pw"))
            assert_same_as_cold(model, ids, wrong)
            assert wrong.stats().hit_tokens == 0 and wrong.stats().remote_errors == 1
            wrong.detach()
        right = _fresh(model, server.url)
        assert_same_as_cold(model, ids, right)
        assert right.stats().remote_hit_tokens == 32
        right.detach()
        assert "s3cret" not in caplog.text and "wrong-pw" not in caplog.text
        assert "***" in caplog.text
    finally:
        server.stop()


def test_tls_url_shares_entries() -> None:
    """A `rediss://` URL (TLS, with the server's CA in the URL) writes and reads chunks like a plain one."""
    server = RedisServer(tls=True)
    try:
        model = cached_model("llama")
        ids = distinct_prompt(11, 40)
        writer = _store(model, server.url, remote_write="through")
        generate(model, ids, past_key_values=writer)
        writer.detach()
        assert writer.stats().remote_bytes_written > 0 and len(_keys(server)) == 5
        reader = _fresh(model, server.url)
        assert_same_as_cold(model, ids, reader)
        assert reader.stats().remote_hit_tokens == 32
        reader.detach()
    finally:
        server.stop()


def test_redact_hides_passwords_only() -> None:
    """Logged URLs keep the host and user but never the password."""
    assert redact("rediss://u:p@h:6380/1") == "rediss://u:***@h:6380/1"
    assert redact("redis://:p@h") == "redis://:***@h"
    assert redact("redis://h:6379/0") == "redis://h:6379/0"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"remote": "http://localhost:6379"}, "redis://, rediss://, unix:// or redis.cluster://"),
        ({"remote": "redis://localhost:1", "remote_write": "always"}, "'back' or 'through'"),
        ({"remote": "redis://localhost:1", "remote_chunk_len": 0}, "remote_chunk_len"),
        ({"remote": "redis://localhost:1", "remote_timeout": 0}, "remote_timeout"),
        ({"max_remote_bytes": "1GB"}, "needs remote"),
        ({"remote_write": "through"}, "needs remote"),
    ],
)
def test_bad_remote_arguments_are_named(kwargs: dict[str, Any], message: str) -> None:
    """Wrong remote settings raise a ValueError saying what to give instead."""
    with pytest.raises(ValueError, match=message):
        PrefixCache(cached_model("llama"), attach=False, **kwargs)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["llama", "bamba"])
def test_gpu_entries_travel_through_the_server(server: RedisServer, name: str) -> None:
    """GPU keys/values and snapshots written through and evicted to the server come back to the GPU exactly."""
    model = build(name).to("cuda")
    try:
        writer = _store(model, server.url, remote_write="through", snapshot_interval=CHUNK)
        prompts = [distinct_prompt(seed, 40).cuda() for seed in (1, 2)]
        for ids in prompts:
            generate(model, ids, past_key_values=writer)
        writer.detach()
        reader = _fresh(model, server.url, snapshot_interval=CHUNK)
        for ids in prompts:
            assert_same_as_cold(model, ids, reader)
        assert reader.stats().remote_hit_tokens == 64
        reader.check_integrity()
        seg = next(n.value for n in reader._store._tree.iter_nodes() if n.value is not None and n.value.run is not None)
        assert seg.run is not None and all(k is None or k.is_cuda for k in seg.run.keys)
        reader.detach()
    finally:
        model.to("cpu")


def test_the_remote_tier_speaks_the_tier_verbs(server: RedisServer) -> None:
    """`put` then `flush` store a sequence's whole chunks; `get` loads the longest stored run of a range, equal."""
    layout = Layout(num_layers=2, kv_layers=(0, 1), state_layers=())
    tier = RemoteTier(server.url, layout, chunk_len=CHUNK)
    gen = torch.Generator().manual_seed(0)
    keys = [torch.randn(1, 2, 3 * CHUNK + 2, 4, generator=gen) for _ in range(2)]
    values = [torch.randn(1, 2, 3 * CHUNK + 2, 4, generator=gen) for _ in range(2)]
    run = Run(keys, values, 0, 3 * CHUNK + 2)
    run.take()
    seg = Segment(run, 0, 3 * CHUNK + 2, run.nbytes_per_token)
    symbols = tuple(range(100, 100 + 3 * CHUNK + 2))
    assert tier.put(seg, Standalone("ns", symbols, (seg,))) is None  # the caller holds nothing for it
    assert _keys(server) == []  # queued: written by `flush`, outside the store's lock
    tier.flush()
    assert len(_keys(server)) == 3  # whole chunks only
    hit = tier.get(Segment(None, CHUNK, 5 * CHUNK, 0), Standalone("ns", (*symbols, *range(2 * CHUNK - 2))))
    assert (hit.start, hit.end) == (CHUNK, 3 * CHUNK) and hit.run is not None
    for got, want in zip([*hit.run.keys, *hit.run.values], [*keys, *values], strict=True):
        assert got is not None and torch.equal(got, want[..., CHUNK : 3 * CHUNK, :])
    tier.drop(hit)
    assert hit.run.num_refs == 0
    other = tier.get(Segment(None, 0, 2 * CHUNK, 0), Standalone("ns", tuple(range(2 * CHUNK))))
    assert (other.start, other.end, other.run) == (0, 0, None)  # nothing stored for these symbols
    server.stop()
    with pytest.raises(RemoteUnavailableError):
        tier.get(Segment(None, 0, 2 * CHUNK, 0), Standalone("ns", symbols[: 2 * CHUNK]))
