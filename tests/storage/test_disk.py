"""The disk tier: entries persist across a real process restart, files are atomic and checksummed,
bad or foreign files are skipped without losing anything else, and bytes on disk are counted exactly."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import assert_same_as_cold, cached_model, generate, kv_bytes_per_token, random_prompt

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.storage.tiers import DISK
from hf_prefix_cache.testing.tiny_models import build

TESTS = Path(__file__).parents[1]


def _files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.safetensors"))


def _tensor_bytes(path: Path) -> int:
    """Bytes of tensor data a safetensors file declares (its header's data offsets)."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")


def _snapshot_bytes(store: PrefixCache) -> int:
    return sum(s.nbytes for n in store._store._tree.iter_nodes() if n.tier == DISK for s in n.value.snapshots.values())


@pytest.fixture
def llama() -> Any:
    return cached_model("llama")


def _write_in_another_process(disk_dir: Path, model_name: str, seeds: list[int], new: int = 4) -> str:
    """Generate through a store with `disk_dir` in a fresh Python process, which saves it at exit."""
    script = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {str(TESTS)!r})
        from hf_prefix_cache.testing.tiny_models import build, random_prompt
        from hf_prefix_cache import PrefixCache
        model = build({model_name!r})
        store = PrefixCache(model, disk_dir={str(disk_dir)!r})
        for seed in {seeds!r}:
            ids = random_prompt(40, seed=seed)
            model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=store,
                           max_new_tokens={new}, do_sample=False)
        print(store.stats().nbytes)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_entries_survive_a_process_restart(llama: Any, tmp_path: Path) -> None:
    """A second process with the same model and disk_dir hits what the first one generated, exactly."""
    _write_in_another_process(tmp_path, "llama", [31, 32])
    files = _files(tmp_path)
    assert len(files) == 2 and not list(tmp_path.rglob("*.tmp"))
    store = PrefixCache(llama, disk_dir=tmp_path)
    try:
        ids = torch.cat([random_prompt(40, seed=31), random_prompt(5, seed=33)], 1)
        warm = assert_same_as_cold(llama, ids, store)
        assert store.stats().hit_tokens == 40
        assert store.stats().reloads == 1
        # The other entry is still on disk and counted exactly.
        stats = store.stats()
        assert stats.disk_nbytes == sum(_tensor_bytes(f) for f in _files(tmp_path)) + _snapshot_bytes(store) > 0
        assert warm is not None
        store.check_integrity()
    finally:
        store.detach()


def test_recurrent_model_snapshots_persist(tmp_path: Path) -> None:
    """A hybrid model's snapshots go to disk with their keys and restore exactly in a new process."""
    _write_in_another_process(tmp_path, "jamba", [34])
    model = cached_model("jamba")
    store = PrefixCache(model, disk_dir=tmp_path)
    try:
        assert_same_as_cold(model, torch.cat([random_prompt(40, seed=34), random_prompt(5, seed=35)], 1), store)
        assert store.stats().hit_tokens == 39  # the snapshot after prompt token 39
        store.check_integrity()
    finally:
        store.detach()


def test_other_weights_dtype_or_salt_never_load_the_files(llama: Any, tmp_path: Path) -> None:
    """Files written for one model are invisible to another model's weights, dtype or salt."""
    _write_in_another_process(tmp_path, "llama", [36])
    ids = random_prompt(40, seed=36)
    other = cached_model("llama").__class__(cached_model("llama").config)  # same config, fresh random weights
    other.eval()
    for model, kwargs in ((other, {}), (llama, {"salt": "tenant-b"})):
        store = PrefixCache(model, disk_dir=tmp_path, save_on_exit=False, **kwargs)
        try:
            generate(model, ids, new=1, past_key_values=store)
            assert store.stats().hit_tokens == 0
        finally:
            store.detach()
            store.clear()
    half = build("llama").to(torch.bfloat16)  # a fresh copy: casting back would not restore the weights
    store = PrefixCache(half, disk_dir=tmp_path, save_on_exit=False)
    with store.lookup(ids) as hit:
        assert hit.cached_len == 0
    assert len(_files(tmp_path)) == 1  # the original file is untouched


@pytest.fixture(scope="module")
def two_entries(tmp_path_factory: Any) -> Path:
    """A disk_dir holding two llama entries, written once by another process; tests copy it."""
    root = tmp_path_factory.mktemp("two_entries")
    _write_in_another_process(root, "llama", [41, 42])
    return root


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "foreign_meta"])
def test_a_bad_file_is_skipped_and_nothing_else_is_lost(
    llama: Any, tmp_path: Path, two_entries: Path, damage: str, caplog: Any
) -> None:
    """A corrupted, truncated, non-safetensors or foreign file costs its own entry only, with a warning."""
    shutil.copytree(two_entries, tmp_path, dirs_exist_ok=True)
    good_ids, bad_ids = random_prompt(40, seed=41), random_prompt(40, seed=42)
    store = PrefixCache(llama, disk_dir=tmp_path, attach=False, save_on_exit=False)
    bad_file = next(n.value.disk.path for n in _leaf_nodes(store, bad_ids))
    raw = bad_file.read_bytes()
    if damage == "flip":
        bad_file.write_bytes(raw[:-100] + bytes(b ^ 0xFF for b in raw[-100:]))
    elif damage == "truncate":
        bad_file.write_bytes(raw[: len(raw) // 2])
    elif damage == "garbage":
        bad_file.write_bytes(b"not a safetensors file at all")
    else:
        header_len = int.from_bytes(raw[:8], "little")
        text = raw[8 : 8 + header_len].decode().replace(store._store.namespace(), "0" * 32)
        bad_file.write_bytes(len(text.encode()).to_bytes(8, "little") + text.encode() + raw[8 + header_len :])
    store = PrefixCache(llama, disk_dir=tmp_path, save_on_exit=False)
    try:
        caplog.set_level("WARNING", logger="hf_prefix_cache")
        assert_same_as_cold(llama, bad_ids, store)
        assert store.stats().hit_tokens == 0
        assert any(str(bad_file) in r.getMessage() for r in caplog.records)
        before = store.stats().hit_tokens
        assert_same_as_cold(llama, good_ids, store)
        assert store.stats().hit_tokens - before == 39
        assert store.stats().skipped_files == 1
        store.check_integrity()
    finally:
        store.detach()


def _leaf_nodes(store: PrefixCache, ids: torch.Tensor) -> list[Any]:
    store._store._placement.index_disk(store._store.namespace())
    return list(store._store._tree.match(store._store.namespace(), ids[0].tolist()).path)


def test_disk_budget_deletes_the_least_recently_used_files(llama: Any, tmp_path: Path) -> None:
    """Past the disk budget the oldest entries' files are deleted; bytes on disk match the count."""
    per_token = kv_bytes_per_token(llama)
    store = PrefixCache(llama, max_device_bytes=1, max_host_bytes=0, disk_dir=tmp_path, max_disk_bytes=100 * per_token)
    try:
        for seed in range(5):
            ids = random_prompt(30, seed=50 + seed)
            ids[0, 0] = 10 + seed
            generate(llama, ids, past_key_values=store)
            stats = store.stats()
            assert stats.device_nbytes == 0 and 0 < stats.disk_nbytes <= 100 * per_token
            assert stats.disk_nbytes == sum(_tensor_bytes(f) for f in _files(tmp_path))
            store.check_integrity()
        assert store.stats().evictions == 3 and len(_files(tmp_path)) == 2
    finally:
        store.detach()


def test_split_disk_entry_serves_both_halves_and_rewrites_on_drop(llama: Any, tmp_path: Path) -> None:
    """A prompt leaving a disk entry midway reuses its head; dropping the tail rewrites the file to the head."""
    store = PrefixCache(llama, max_device_bytes=1, max_host_bytes=0, disk_dir=tmp_path)
    try:
        ids = random_prompt(40, seed=61)
        generate(llama, ids, past_key_values=store)
        branch = torch.cat([ids[:, :20], random_prompt(10, seed=62)], 1)
        branch[0, 20] = (int(ids[0, 20]) + 1) % 100 + 4
        assert_same_as_cold(llama, branch, store)
        assert store.stats().hit_tokens == 20
        store.check_integrity()
        tail = store._store._tree.match(store._store.namespace(), ids[0].tolist()).path[-1]
        assert tail.tier == DISK
        store._store._placement.drop(tail)
        store._store._placement.disk.flush()
        store.check_integrity()
        assert store.stats().disk_nbytes == sum(_tensor_bytes(f) for f in _files(tmp_path))
        with store.lookup(ids) as hit:
            assert hit.cached_len == 20
    finally:
        store.detach()


def test_save_moves_memory_entries_to_disk_and_clear_deletes_them(llama: Any, tmp_path: Path) -> None:
    """`save()` writes what is in memory; `clear()` removes the files too."""
    store = PrefixCache(llama, disk_dir=tmp_path, save_on_exit=False)
    try:
        generate(llama, random_prompt(30, seed=71), past_key_values=store)
        assert store.stats().disk_nbytes == 0 and not _files(tmp_path)
        assert store.save() == 1
        assert store.stats().device_nbytes == 0 and len(_files(tmp_path)) == 1
        store.clear()
        assert not _files(tmp_path) and store.stats().nbytes == 0
    finally:
        store.detach()
    with pytest.raises(ValueError, match="disk_dir"):
        PrefixCache(llama, attach=False).save()
