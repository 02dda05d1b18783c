"""Random inserts, lookups, saves and budget changes across all three tiers never serve a wrong
key: every restored position holds exactly the key computed for that query prefix, every tier
stays within its budget, tiers stay monotone along paths, and the store's integrity holds."""

from __future__ import annotations

import tempfile
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from transformers import LlamaConfig, LlamaForCausalLM

from hf_prefix_cache import PrefixCache

HEADS, HEAD_DIM = 1, 4
PER_TOKEN = 2 * HEADS * HEAD_DIM * 4  # one layer, keys and values, float32


def _model() -> Any:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=HEADS, head_dim=HEAD_DIM, eos_token_id=None,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def _prefix_code(tokens: list[int]) -> list[float]:
    """A number per position that depends on the whole prefix up to it (like a real key does)."""
    codes, h = [], 0
    for t in tokens:
        h = (h * 31 + t + 1) % 1_000_003
        codes.append(float(h))
    return codes


def _kv(tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    code = torch.tensor(_prefix_code(tokens))[None, None, :, None].expand(1, HEADS, len(tokens), HEAD_DIM)
    return code.clone(), code.clone() + 0.5


MODEL = _model()
sequences = st.lists(st.integers(0, 3), min_size=1, max_size=24)


class TieredStore(RuleBasedStateMachine):
    @initialize()
    def make(self) -> None:
        self.tmp = tempfile.TemporaryDirectory()
        self.store = PrefixCache(
            MODEL,
            max_device_bytes=30 * PER_TOKEN,
            max_host_bytes=40 * PER_TOKEN,
            disk_dir=self.tmp.name,
            max_disk_bytes=60 * PER_TOKEN,
            attach=False,
            save_on_exit=False,
        )

    @rule(tokens=sequences)
    def insert(self, tokens: list[int]) -> None:
        cache = self.store._store.new_cache()
        keys, values = _kv(tokens)
        adapter = self.store._store.profile.adapters[0]
        adapter.restore_kv(cache.layers[0], keys, values, len(tokens))
        self.store.insert(tokens, cache)

    @rule(tokens=sequences)
    def lookup(self, tokens: list[int]) -> None:
        with self.store.lookup(tokens) as hit:
            n = hit.cached_len
            assert n <= len(tokens) - 1
            if n:
                layer = hit.cache.layers[0]
                expected_k, expected_v = _kv(tokens[:n])
                assert torch.equal(layer.keys, expected_k), f"wrong keys restored for {tokens[:n]}"
                assert torch.equal(layer.values, expected_v)

    @rule()
    def save(self) -> None:
        self.store.save()

    @rule(tokens=st.integers(5, 40))
    def resize_device(self, tokens: int) -> None:
        self.store.max_bytes = tokens * PER_TOKEN

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "store"):
            return
        self.store.check_integrity()
        stats = self.store.stats()
        budgets = self.store.budgets
        assert stats.device_nbytes <= budgets["device"]
        assert stats.host_nbytes <= budgets["host"]
        assert stats.disk_nbytes <= budgets["disk"]
        for node in self.store._store._tree.iter_nodes():
            assert node.parent.is_root or node.tier >= node.parent.tier, f"{node} faster than its parent"

    def teardown(self) -> None:
        if hasattr(self, "tmp"):
            self.tmp.cleanup()


TestTieredStore = TieredStore.TestCase
TestTieredStore.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
