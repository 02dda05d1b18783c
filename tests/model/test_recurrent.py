"""Recurrent models: snapshots survive the disk tier whole, interval snapshots on a first request,
and exact multi-token continuation for the Mamba-1-style scans (Mamba, FalconMamba, Jamba)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import LOGIT_TOL, Hits, assert_same_as_cold, cached_model, generate, max_logit_diff, random_prompt
from transformers import DynamicCache

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.storage.tiers import DISK

TESTS = Path(__file__).parents[1]
INTERVAL = 16
PROMPT_LEN = 70  # snapshots at 16, 32, 48, 64, 69 (before the last token) and the answer's end
NEW = 4


def _snapshot_len(model: Any) -> int:
    """Bytes of one snapshot of `model`'s states (all its stateful layers)."""
    store = PrefixCache(model, attach=False)
    cache = store._store.new_cache()
    with torch.no_grad():
        model(random_prompt(4, seed=9), **{store._store.profile.cache_kwarg: cache}, use_cache=True)
    return cache.snapshot(4).nbytes


def _disk_snapshots(store: PrefixCache) -> list[int]:
    return sorted(n for node in store._store._tree.iter_nodes() if node.tier == DISK for n in node.value.snapshots)


@pytest.mark.parametrize("name", ["mamba", "mamba2", "bamba", "jamba"])
def test_an_entry_bigger_than_the_device_budget_keeps_every_snapshot_on_disk(name: str, tmp_path: Path) -> None:
    """An entry sent to disk keeps all its snapshots: the same store and a new one hit the full length."""
    model = cached_model(name)
    budget = 2 * _snapshot_len(model)  # far below one entry (six snapshots, plus keys for the hybrids)
    prompt = random_prompt(PROMPT_LEN, seed=51)
    diverging = torch.cat([prompt[:, :40], random_prompt(20, seed=52)], 1)
    store = PrefixCache(model, max_bytes=budget, disk_dir=tmp_path, snapshot_interval=INTERVAL, save_on_exit=False)
    try:
        hits = Hits(store)
        assert_same_as_cold(model, prompt, store, new=NEW)
        assert store.stats().disk_nbytes > 0 and store.stats().device_nbytes <= budget
        assert _disk_snapshots(store) == [16, 32, 48, 64, 69, PROMPT_LEN + NEW - 1]
        assert_same_as_cold(model, prompt, store, new=NEW)
        assert hits.last() == PROMPT_LEN - 1
        store.check_integrity()
    finally:
        store.detach()
    # A new store (nothing in memory) finds the same entry in its files.
    fresh = PrefixCache(model, max_bytes=budget, disk_dir=tmp_path, snapshot_interval=INTERVAL, save_on_exit=False)
    try:
        hits = Hits(fresh)
        assert_same_as_cold(model, prompt, fresh, new=NEW)
        assert hits.last() == PROMPT_LEN - 1
        assert_same_as_cold(model, diverging, fresh, new=NEW)
        assert hits.last() == 32  # the last interval snapshot before the divergence at 40
        assert fresh.stats().skipped_files == 0
        fresh.check_integrity()
    finally:
        fresh.detach()


def test_snapshots_added_to_a_split_disk_entry_persist(tmp_path: Path) -> None:
    """A divergence inside an entry on disk snapshots there; the file is rewritten and a restart restores it."""
    model = cached_model("mamba2")
    prompt = random_prompt(PROMPT_LEN, seed=53)
    diverging = torch.cat([prompt[:, :40], random_prompt(20, seed=54)], 1)
    other = torch.cat([prompt[:, :40], random_prompt(25, seed=55)], 1)
    kwargs: dict[str, Any] = {"disk_dir": tmp_path, "snapshot_interval": None, "save_on_exit": False}
    store = PrefixCache(model, max_bytes=_snapshot_len(model) * 3 // 2, **kwargs)  # not one entry
    try:
        hits = Hits(store)
        assert_same_as_cold(model, prompt, store, new=NEW)
        assert_same_as_cold(model, diverging, store, new=NEW)  # no snapshot before 40: nothing reused
        assert hits.last() == 0
        assert 40 in _disk_snapshots(store)  # the divergence snapshot went into the rewritten file
        store.check_integrity()
    finally:
        store.detach()
    fresh = PrefixCache(model, **kwargs)
    try:
        hits = Hits(fresh)
        assert_same_as_cold(model, other, fresh, new=NEW)
        assert hits.last() == 40
        assert fresh.stats().skipped_files == 0
        fresh.check_integrity()
    finally:
        fresh.detach()


def test_a_new_process_hits_the_full_length_of_a_recurrent_entry(tmp_path: Path) -> None:
    """A Mamba entry written under a small device budget by another process restores at its full length."""
    model = cached_model("mamba")
    budget = 2 * _snapshot_len(model)
    script = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {str(TESTS)!r})
        from hf_prefix_cache.testing.tiny_models import build, random_prompt
        from hf_prefix_cache import PrefixCache
        model = build("mamba")
        store = PrefixCache(model, max_bytes={budget}, disk_dir={str(tmp_path)!r}, snapshot_interval={INTERVAL})
        ids = random_prompt({PROMPT_LEN}, seed=56)
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=store, max_new_tokens={NEW},
                       do_sample=False)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    store = PrefixCache(model, disk_dir=tmp_path, snapshot_interval=INTERVAL, save_on_exit=False)
    try:
        hits = Hits(store)
        assert_same_as_cold(model, random_prompt(PROMPT_LEN, seed=56), store, new=NEW)
        assert hits.last() == PROMPT_LEN - 1
        store.check_integrity()
    finally:
        store.detach()


@pytest.mark.parametrize("name", ["mamba", "falcon_mamba", "jamba"])
def test_a_continued_scan_equals_the_models_own_one_token_steps(name: str) -> None:
    """Several tokens on a working cache match the model's one-token steps and its cold run, unlike a plain cache."""
    model = cached_model(name)
    store = PrefixCache(model)
    kwarg = store._store.profile.cache_kwarg
    ids = random_prompt(50, seed=57)
    cut = 23

    def positions(a: int, b: int) -> dict[str, Any]:
        return {"position_ids": torch.arange(a, b)[None]} if store._store.profile.accepts_position_ids else {}

    def run(cache: Any, one_by_one: bool) -> torch.Tensor:
        first = model(ids[:, :cut], **{kwarg: cache}, use_cache=True, **positions(0, cut)).logits
        if not one_by_one:
            rest = model(ids[:, cut:], **{kwarg: cache}, use_cache=True, **positions(cut, 50)).logits
            return torch.cat([first, rest], 1)
        steps = [
            model(ids[:, t : t + 1], **{kwarg: cache}, use_cache=True, **positions(t, t + 1)).logits
            for t in range(cut, 50)
        ]
        return torch.cat([first, *steps], 1)

    try:
        with torch.no_grad():
            cold = model(ids).logits
            steps = run(store._store.new_cache(), one_by_one=True)
            continued = run(store._store.new_cache(), one_by_one=False)
            plain = run(DynamicCache(config=model.config), one_by_one=False)
        floor = (steps - cold).abs().max().item()  # the model's own split floor
        assert (continued - steps).abs().max().item() <= max(2 * floor, 1e-6)
        assert (continued - cold).abs().max().item() < LOGIT_TOL
        assert (plain - cold).abs().max().item() > LOGIT_TOL  # transformers alone starts the scan from zeros
    finally:
        store.detach()


@pytest.mark.parametrize("name", ["mamba", "jamba"])
def test_a_first_request_takes_interval_snapshots(name: str) -> None:
    """A cold prompt is snapshotted every `snapshot_interval` tokens, so a prompt sharing only its start reuses it."""
    model = cached_model(name)
    store = PrefixCache(model, snapshot_interval=INTERVAL)
    try:
        hits = Hits(store)
        system = random_prompt(40, seed=58)
        assert_same_as_cold(model, torch.cat([system, random_prompt(10, seed=59)], 1), store)
        assert hits.last() == 0
        question = random_prompt(10, seed=60)
        question[0, 0] = 99
        assert_same_as_cold(model, torch.cat([system, question], 1), store)
        assert hits.last() == 32
        store.check_integrity()
    finally:
        store.detach()


def _own_split_floor(model: Any, ids: torch.Tensor, cut: int, one_token_steps: bool) -> float:
    """How far the model's own split prefill (no store) lands from its cold run: `[0, cut)`, then the rest."""
    kwarg = "cache_params" if "Mamba" in type(model).__name__ else "past_key_values"
    with torch.no_grad():
        cold = model(ids).logits[:, -1]
        cache = DynamicCache(config=model.config)
        model(ids[:, :cut], **{kwarg: cache}, use_cache=True)
        rest = [ids[:, t : t + 1] for t in range(cut, ids.shape[1])] if one_token_steps else [ids[:, cut:]]
        for chunk in rest:
            last = model(chunk, **{kwarg: cache}, use_cache=True).logits[:, -1]
    return float((last - cold).abs().max())


@pytest.mark.parametrize("name", ["mamba", "mamba2"])
def test_a_hit_is_within_the_models_own_split_floor(name: str) -> None:
    """A hit's logits lie within the model's own split-prefill difference (measured here), the README's bound."""
    import transformers

    torch.manual_seed(0)
    sizes = {"hidden_size": 192, "num_hidden_layers": 6, "vocab_size": 128, "eos_token_id": None}
    if name == "mamba":
        model = transformers.MambaForCausalLM(transformers.MambaConfig(state_size=16, **sizes))
    else:
        config = transformers.Mamba2Config(num_heads=6, head_dim=64, state_size=64, n_groups=1, chunk_size=32, **sizes)
        model = transformers.Mamba2ForCausalLM(config)
    model.eval()
    model.generation_config.eos_token_id = None
    stored = random_prompt(100, seed=61)
    ids = torch.cat([stored, random_prompt(40, seed=62)], 1)
    store = PrefixCache(model, snapshot_interval=32)
    try:
        generate(model, stored, new=1, past_key_values=store)
        hits = Hits(store)
        cold = generate(model, ids, new=1)
        warm = generate(model, ids, new=1, past_key_values=store)
        assert hits.last() == 100 and torch.equal(cold.sequences, warm.sequences)
        floor = _own_split_floor(model, ids, 100, one_token_steps=name == "mamba")
        diff = max_logit_diff(cold, warm)
        assert diff <= 2 * floor + 1e-6, f"hit {diff:.1e} from cold, the model's own split floor is {floor:.1e}"
    finally:
        store.detach()
