"""The disk tier under altered files, unusable folders, a full disk and a process killed mid-write."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Hits, assert_same_as_cold, build, distinct_prompt

from hf_prefix_cache import PrefixCache


def _alter_symbol(path: Path, position: int) -> tuple[int, int]:
    """Swap the token id at `position` in a segment file's JSON header for another of the same length."""
    raw = bytearray(path.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    header = raw[8 : 8 + header_len].decode()
    match = re.search(r'symbols\\": \[([0-9, ]*)\]', header)
    assert match is not None, header[:200]
    ids = [int(x) for x in match.group(1).split(", ")]
    old = ids[position]
    new = old + 1 if len(str(old + 1)) == len(str(old)) else old - 1
    ids[position] = new
    text = ", ".join(map(str, ids))
    assert len(text) == len(match.group(1))
    header = header[: match.start(1)] + text + header[match.end(1) :]
    raw[8 : 8 + header_len] = header.encode()
    path.write_bytes(bytes(raw))
    return old, new


def test_a_file_whose_header_was_altered_is_never_served(tmp_path: Path) -> None:
    """One token id swapped in a saved file's header (same length) fails the checksum: the prompt it now names runs cold."""
    model = build("llama")
    ids = distinct_prompt(1, 24)
    store = PrefixCache(model, disk_dir=tmp_path, save_on_exit=False)
    assert_same_as_cold(model, ids, store)
    store.save()
    store.detach()
    (path,) = tmp_path.rglob("*.safetensors")
    old, new = _alter_symbol(path, 5)
    altered = ids.clone()
    assert int(altered[0, 5]) == old
    altered[0, 5] = new

    fresh = PrefixCache(model, disk_dir=tmp_path, save_on_exit=False)
    hits = Hits(fresh)
    try:
        assert_same_as_cold(model, altered, fresh)
        assert hits.last() == 0
        assert fresh.stats().skipped_files == 1
        fresh.check_integrity()
    finally:
        fresh.detach()


@pytest.mark.parametrize("kind", ["empty", "file", "under_a_file"])
def test_an_unusable_disk_dir_is_refused_when_the_store_is_made(tmp_path: Path, kind: str) -> None:
    """An empty path, a file, or a path below a file raises a ValueError naming it, before anything is stored."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    disk_dir = {"empty": "", "file": str(afile), "under_a_file": str(afile / "cache")}[kind]
    with pytest.raises(ValueError, match="disk_dir") as err:
        PrefixCache(build("llama"), disk_dir=disk_dir, attach=False)
    assert kind == "empty" or str(afile) in str(err.value)


def test_disk_dir_expands_the_home_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`disk_dir="~/cache"` is the home folder's `cache`, not a literal `./~` folder."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    model = build("llama")
    store = PrefixCache(model, disk_dir="~/cache", save_on_exit=False)
    try:
        assert_same_as_cold(model, distinct_prompt(1), store)
        assert store.save() == 1
    finally:
        store.detach()
    assert not (work / "~").exists()
    assert len(list((tmp_path / "home" / "cache").rglob("*.safetensors"))) == 1


def test_a_full_disk_keeps_entries_in_memory_and_logs_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """ENOSPC at the write: every request is served exactly, entries stay in memory, one warning; writes resume later."""
    import errno

    from hf_prefix_cache.storage import disk

    real_save = disk.save_file

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk, "save_file", full)
    model = build("llama")
    prompts = [distinct_prompt(seed) for seed in range(4)]
    one_entry = 2 * 2 * 2 * 8 * 4 * (prompts[0].shape[1] + 5)  # layers x (k, v) x kv heads x head dim x fp32
    store = PrefixCache(model, max_bytes=one_entry, disk_dir=tmp_path, save_on_exit=False)
    hits = Hits(store)
    try:
        with caplog.at_level(logging.DEBUG, logger="hf_prefix_cache"):
            for ids in prompts:
                assert_same_as_cold(model, ids, store)
            assert store.save() == 0
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and "disk tier" in r.getMessage()]
        assert len(warnings) == 1, [r.getMessage() for r in warnings]
        assert store.stats().entries == len(prompts)
        assert store.stats().evictions == 0
        assert store.stats().failed_moves >= 1  # counted, not only logged
        for ids in prompts:
            assert_same_as_cold(model, ids, store)
            assert hits.last() == ids.shape[1] - 1
        monkeypatch.setattr(disk, "save_file", real_save)
        assert store.save() > 0
        assert store.stats().disk_nbytes > 0
        store.check_integrity()
    finally:
        store.detach()
    assert not list(tmp_path.rglob("*.tmp"))


_KILL_ROUNDS = 20
_ENTRIES = 30
_LEN = 12


def _entry(round_: int, i: int, store: PrefixCache) -> tuple[list[int], Any, list[torch.Tensor]]:
    """Entry `i` of round `round_`: distinct ids, a working cache of seeded keys/values, and its keys."""
    gen = torch.Generator().manual_seed(1000 * round_ + i)
    ids = [4 + (round_ * _ENTRIES + i) % 96, *torch.randint(4, 100, (_LEN - 1,), generator=gen).tolist()]
    ids[1] = 4 + round_  # rounds never share a two-token prefix
    cache = store._store.new_cache()
    keys = []
    for layer in range(2):
        k = torch.randn(1, 2, _LEN, 16, generator=gen)
        v = torch.randn(1, 2, _LEN, 16, generator=gen)
        cache.update(k, v, layer)
        keys.append(k)
    return ids, cache, keys


def _write_entries(round_: int, disk: Path, report: int) -> None:
    """In a forked child: store and save entries one by one, reporting each finished write on `report`."""
    store = PrefixCache(build("llama"), disk_dir=disk, save_on_exit=False, attach=False)
    for i in range(_ENTRIES):
        ids, cache, _ = _entry(round_, i, store)
        store.insert(ids, cache)
        store.save()
        os.write(report, f"{i}\n".encode())


def test_sigkill_while_writing_the_disk_tier_loses_only_unfinished_writes(tmp_path: Path) -> None:
    """A process killed at random points while saving: a new store loads nothing half-written and hits every finished entry."""
    import random
    import select
    import signal
    import time

    rng = random.Random(0)
    disk = tmp_path / "cache"
    model = build("llama")
    # How long the child's writes take here, so the kills land inside them.
    probe = PrefixCache(model, disk_dir=tmp_path / "timing", save_on_exit=False, attach=False)
    started = time.perf_counter()
    for i in range(5):
        ids, cache, _ = _entry(99, i, probe)
        probe.insert(ids, cache)
        probe.save()
    write_seconds = (time.perf_counter() - started) / 5
    partial_rounds = 0
    for round_ in range(_KILL_ROUNDS):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            try:
                os.close(read)
                # The parent's OpenMP thread pool does not survive a fork; a child that used it hung
                # (CI, where OMP_NUM_THREADS is unset), so the child runs its ops on one thread.
                torch.set_num_threads(1)
                _write_entries(round_, disk, write)
            finally:
                os._exit(0)
        os.close(write)
        # Time the kill by the child's own pace, read from its reports: after a random number of
        # finished writes, a random point inside the next one. (A pace measured in the parent, or
        # timed from the fork, missed the writes whenever the machine's load changed.)
        reports = b""
        stamps: list[float] = []
        kill_after = rng.randint(1, _ENTRIES - 2)
        while len(reports.split()) < kill_after:
            ready, _, _ = select.select([read], [], [], 120)
            assert ready, f"round {round_}: the child wrote nothing in 120 s"
            chunk = os.read(read, 64)
            assert chunk, f"round {round_}: the child exited early"
            reports += chunk
            stamps.append(time.perf_counter())
        per_write = (stamps[-1] - stamps[0]) / max(len(reports.split()) - 1, 1) if len(stamps) > 1 else write_seconds
        time.sleep(rng.uniform(0.0, min(per_write, write_seconds)))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        with os.fdopen(read, "rb") as f:
            finished = {int(line) for line in (reports + f.read()).split()}
        partial_rounds += 0 < len(finished) < _ENTRIES

        store = PrefixCache(model, disk_dir=disk, save_on_exit=False, attach=False)
        for i in range(_ENTRIES):
            ids, _, keys = _entry(round_, i, store)
            with store.lookup(ids) as hit:
                if i in finished:
                    assert hit.cached_len == _LEN - 1, f"round {round_}: finished entry {i} is not hit"
                if hit.cached_len:  # a write may finish just before its report: it must then be whole
                    for layer, k in enumerate(keys):
                        assert torch.equal(hit.cache.layers[layer].keys, k[:, :, : _LEN - 1])
        assert store.stats().skipped_files == 0
        assert not list(disk.rglob("*.tmp")), "an unfinished write was left behind"
        store.check_integrity()
    assert partial_rounds >= _KILL_ROUNDS // 4, f"only {partial_rounds} kills landed mid-run"
