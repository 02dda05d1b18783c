"""Default budgets follow the memory and disk space actually free, and `stats()` shows them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import cached_model

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.storage import budgets

_GiB = 1 << 30


def test_the_default_device_budget_follows_available_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine with 2 GiB available (whatever its total RAM) a CPU model's store takes a quarter of that."""
    monkeypatch.setattr(budgets, "available_ram_bytes", lambda: 2 * _GiB)
    store = PrefixCache(cached_model("llama"), attach=False)
    stats = store.stats()
    assert (stats.max_bytes, stats.max_host_bytes, stats.max_disk_bytes) == (_GiB // 2, 0, 0)


def test_default_budgets_fit_this_machine(tmp_path: Path) -> None:
    """The real defaults stay within a quarter of available memory and half the free disk space."""
    store = PrefixCache(cached_model("llama"), disk_dir=tmp_path / "not" / "made" / "yet", attach=False)
    stats = store.stats()
    assert 0 < stats.max_bytes <= min(budgets.available_ram_bytes() // 4 * 11 // 10, 8 * _GiB)
    free = shutil.disk_usage(tmp_path).free
    assert 0 < stats.max_disk_bytes <= min(free // 2 * 11 // 10, 20 * _GiB)
