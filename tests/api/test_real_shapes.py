"""Real checkpoint shapes: every size-dependent path at 1B to 70B.

Fast: stores on meta-device models (Llama-3.1-8B and 70B, and the 1B-class configs) build,
profile, fingerprint and count bytes without allocating weights; 70B-sized key/value runs (meta
tensors) are stored, counted to the byte and restored. Slow: random bfloat16 weights at full
size restore and hit, and the store holds the bytes a `DynamicCache` holds for the same tokens.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest
import torch
from accelerate import init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from conftest import Hits, generate, max_logit_diff
from transformers import DynamicCache, LlamaForCausalLM

from hf_prefix_cache import PrefixCache, _compat
from hf_prefix_cache.model.layers.full import FullAttentionAdapter
from hf_prefix_cache.model.layers.recurrent import RecurrentAdapter
from hf_prefix_cache.model.layers.sliding import SlidingWindowAdapter
from hf_prefix_cache.storage.budgets import DEFAULT_DISK_BYTES
from hf_prefix_cache.testing.real_configs import GEMMA3_WINDOW, REAL_CONFIGS, build_real
from hf_prefix_cache.testing.tiny_models import build

_GiB = 1 << 30


@pytest.fixture(scope="module")
def meta_models() -> dict[str, Any]:
    return {name: build_real(name, device="meta") for name in REAL_CONFIGS}


def _kv_nbytes_per_token(config: Any, dtype: torch.dtype) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype.itemsize


@pytest.mark.parametrize("name", list(REAL_CONFIGS))
def test_meta_store_builds_with_the_real_layer_layout(name: str, meta_models: dict[str, Any]) -> None:
    """A store on a meta-device model profiles every layer of the real config and names a namespace."""
    model = meta_models[name]
    store = PrefixCache(model)
    config = model.config
    profile = store._store.profile
    assert profile.unsupported is None
    assert len(profile.adapters) == config.num_hidden_layers
    kinds = [type(a) for a in profile.adapters]
    if name == "mamba-130m":
        # Mamba's forward names the cache `cache_params` before transformers 5.24 and `cache` from it on;
        # either way generate does not slice its prompt, so the hook skips the restored ids itself.
        assert profile.cache_kwarg == ("cache" if _compat.CACHE_RENAMED else "cache_params")
        assert profile.single_token_steps and not profile.prompt_sliced
        assert kinds == [RecurrentAdapter] * 24 and not profile.has_kv
    elif name == "gemma-3-1b":
        full = [i for i, k in enumerate(kinds) if k is FullAttentionAdapter]
        assert full == [5, 11, 17, 23]
        assert kinds.count(SlidingWindowAdapter) == 22
        assert {kw.get("sliding_window") for cls, kw in profile.layer_specs if "Sliding" in cls.__name__} == {
            GEMMA3_WINDOW
        }
    else:
        assert kinds == [FullAttentionAdapter] * config.num_hidden_layers and not profile.has_state
    namespace = store._store.namespace()
    assert len(namespace) == 32 and int(namespace, 16) >= 0
    store.detach()


def test_meta_namespaces_tell_sizes_and_dtypes_apart(meta_models: dict[str, Any]) -> None:
    """Namespaces are stable across builds of one config and differ between sizes and dtypes."""
    spaces = {}
    for name in ("llama-3.2-1b", "llama-3.1-8b", "llama-3.1-70b"):
        store = PrefixCache(meta_models[name], attach=False)
        spaces[name] = store._store.namespace()
        again = PrefixCache(build_real(name, device="meta"), attach=False)
        assert again._store.namespace() == spaces[name]
    assert len(set(spaces.values())) == 3
    f32 = PrefixCache(build_real("llama-3.1-8b", dtype=torch.float32, device="meta"), attach=False)
    assert f32._store.namespace() != spaces["llama-3.1-8b"]


@pytest.mark.parametrize("name", ["llama-3.1-8b", "llama-3.1-70b"])
def test_meta_budgets_at_real_sizes(name: str, meta_models: dict[str, Any], tmp_path: Any) -> None:
    """Default and explicit budgets past 2**32 bytes are exact ints on every tier."""
    model = meta_models[name]
    store = PrefixCache(model, attach=False)
    budgets = store.budgets
    assert all(isinstance(v, int) for v in budgets.values())
    assert 0 < budgets["device"] <= 8 * _GiB and budgets["host"] == 0 and budgets["disk"] == 0
    big = PrefixCache(model, attach=False, max_bytes="80GiB", max_host_bytes="1.5TiB", disk_dir=tmp_path)
    # The default disk budget is half the free space, at most 20 GiB: a machine with under 40 GiB free gets less.
    disk = min(DEFAULT_DISK_BYTES, shutil.disk_usage(tmp_path).free // 2)
    assert abs(big.budgets["disk"] - disk) <= 1 << 26  # other processes write meanwhile
    assert big.budgets["disk"] <= DEFAULT_DISK_BYTES
    assert {k: big.budgets[k] for k in ("device", "host")} == {"device": 80 * _GiB, "host": 3 * (1 << 39)}
    assert big.stats().max_bytes == 85_899_345_920


def _meta_cache(store: PrefixCache, length: int) -> Any:
    """A working cache holding `length` positions of meta keys/values in every layer."""
    config = store.model.config
    cache = store._store.new_cache()
    shape = (1, config.num_key_value_heads, length, config.hidden_size // config.num_attention_heads)
    for i in range(config.num_hidden_layers):
        k = torch.empty(shape, dtype=torch.bfloat16, device="meta")
        cache.update(k, torch.empty_like(k), i)
    return cache


def test_70b_runs_of_128k_tokens_are_counted_to_the_byte(meta_models: dict[str, Any]) -> None:
    """A 131,072-token 70B entry (40 GiB of bfloat16 keys/values) is stored, counted exactly, restored and evicted."""
    model = meta_models["llama-3.1-70b"]
    per_token = _kv_nbytes_per_token(model.config, torch.bfloat16)
    assert per_token == 327_680
    n = 131_072
    store = PrefixCache(model, attach=False, max_bytes="48GiB")
    assert store.insert(list(range(n)), _meta_cache(store, n)) == n
    stats = store.stats()
    assert stats.nbytes == stats.device_nbytes == n * per_token == 42_949_672_960
    with store.lookup([*range(100_000), 7]) as hit:
        assert hit.cached_len == hit.matched_len == 100_000
        assert hit.cache.get_seq_length() == 100_000
        assert hit.cache.layers[79].keys.shape == (1, 8, 100_000, 128)
    # A second 128k entry branching at 65,536 does not fit beside the first: the first is trimmed to the shared part.
    other = [*range(65_536), *range(10**6, 10**6 + n - 65_536)]
    assert store.insert(other, _meta_cache(store, n)) == n - 65_536
    stats = store.stats()
    assert stats.nbytes == n * per_token and stats.entries == 1 and stats.evictions == 1
    store.check_integrity()
    # Larger than every tier: not stored, and said so.
    small = PrefixCache(model, attach=False, max_bytes="32GiB")
    assert small.insert(list(range(n)), _meta_cache(small, n)) == 0
    assert small.stats().fallbacks == {"entry_over_budget": 1} and small.stats().nbytes == 0


def _load_into_empty(model: Any, state: dict[str, torch.Tensor], how: str) -> None:
    if how == "accelerate":  # what load_checkpoint_and_dispatch does, tensor by tensor
        for name, tensor in state.items():
            set_module_tensor_to_device(model, name, "cpu", value=tensor)
    else:
        buffers = {name: b.clone() for name, b in model.named_buffers()}
        model.to_empty(device="cpu")  # allocates every tensor afresh, buffers included
        model.load_state_dict(state)
        for name, b in buffers.items():  # the rotary buffers are not in the state dict
            model.get_buffer(name).copy_(b)


@pytest.mark.parametrize("how", ["accelerate", "to_empty"])
def test_store_made_before_the_weights_are_loaded_fingerprints_them(how: str) -> None:
    """A store built on an empty (meta-device) model takes the weights loaded afterwards into its namespace."""
    real = build("llama")
    ids = torch.arange(4, 40)[None]
    states = {"a": real.state_dict(), "b": {k: v * 1.5 for k, v in real.state_dict().items()}}
    spaces = {}
    for name, state in states.items():
        with init_empty_weights():  # parameters on the meta device, buffers real
            model = LlamaForCausalLM(real.config).eval()
        store = PrefixCache(model)
        _load_into_empty(model, state, how)
        spaces[name] = store._store.namespace()
        if name == "a":
            # The namespace of a store on the model built with these weights: their entries are shared.
            assert spaces[name] == PrefixCache(real, attach=False)._store.namespace()
            cold = generate(model, ids, 4)
            generate(model, ids, 4, past_key_values=store)
            hits = Hits(store)
            warm = generate(model, ids, 4, past_key_values=store)
            assert hits.last() == ids.shape[1] - 1
            assert torch.equal(cold.sequences, warm.sequences) and max_logit_diff(cold, warm) < 1e-4
        store.detach()
    assert spaces["a"] != spaces["b"]


# ---------------------------------------------------------------------------------------------------- slow


def _dynamic_cache_nbytes(cache: DynamicCache) -> int:
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "conv_states", "recurrent_states"):
            held = getattr(layer, name, None)
            # Recurrent layers keep a dict of states (one per sub-state); attention layers one tensor.
            for t in held.values() if isinstance(held, dict) else [held]:
                if isinstance(t, torch.Tensor):
                    total += t.nbytes
    return total


def _replay(model: Any, kwarg: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    """Last logits of feeding `pieces` one forward each on one DynamicCache (Mamba-1: tokens after the first piece one by one)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        for i, piece in enumerate(pieces):
            steps = [piece] if i == 0 or kwarg != "cache_params" else list(piece.split(1, dim=1))
            for step in steps:
                logits = model(step, **{kwarg: cache}, use_cache=True).logits[:, -1]
    return logits


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama-3.2-1b", "qwen2.5-1.5b", "gemma-3-1b", "mamba-130m"])
def test_random_weights_at_real_size_restore_and_hit(name: str) -> None:
    """bfloat16 at full size: a second turn reuses the first exactly as a DynamicCache replay would, and bytes match one.

    The reference for exactness is a replay of the store's own order of work on a plain
    `DynamicCache` (turn 1's prefill, its decode steps, turn 2's new tokens): in bfloat16 a cold
    run, which prefills everything at once, differs from any split of the same work by rounding
    (printed beside the hit's difference). Attention models must also give the cold run's tokens;
    Mamba-1 is not held to that in bfloat16: at this size two valid orders of the same cold work
    (one scan, or a scan then single steps) already differ by several logits.
    """
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model = build_real(name)
    kwarg = "cache_params" if name == "mamba-130m" else "past_key_values"
    # Past Gemma 3's 512-token window, so its sliding layers have dropped positions in a DynamicCache.
    n = GEMMA3_WINDOW + 88 if name == "gemma-3-1b" else 96
    gen = torch.Generator().manual_seed(1)
    turn1 = torch.randint(10, 30000, (1, n), generator=gen)
    store = PrefixCache(model, snapshot_interval=None)
    hits = Hits(store)
    first = generate(model, turn1, 4, past_key_values=store)
    assert hits.last() == 0
    stored = first.sequences[:, :-1]  # what the store keeps: the prompt and the answer but its last token
    turn2 = torch.cat([first.sequences, torch.randint(10, 30000, (1, 16), generator=gen)], dim=1)
    cold = generate(model, turn2, 1)
    warm = generate(model, turn2, 1, past_key_values=store)
    assert store.stats().fallbacks == {}
    reused = hits.last()
    if name == "mamba-130m":
        assert 0 < reused <= stored.shape[1]
        pieces = [turn2[:, : n - 1], turn2[:, n - 1 : reused], turn2[:, reused:]]
    else:
        assert reused == stored.shape[1]
        pieces = [turn1, *first.sequences[:, n:-1].split(1, dim=1), turn2[:, reused:]]
    replay = _replay(model, kwarg, [p for p in pieces if p.shape[1]])
    scale = cold.logits[0].abs().max().item()
    to_replay = (warm.logits[0] - replay).abs().max().item()
    to_cold = (warm.logits[0] - cold.logits[0]).abs().max().item()
    floor = (replay - cold.logits[0]).abs().max().item()
    print(
        f"{name} bf16: hit vs replay {to_replay:.3g}, hit vs cold {to_cold:.3g}, replay vs cold {floor:.3g}, |logits| <= {scale:.3g}"
    )
    assert to_replay <= 1e-2 * scale, f"{name}: the hit is {to_replay} from the replay of the same work"
    if name != "mamba-130m":
        assert torch.equal(cold.sequences, warm.sequences), f"{name}: tokens differ from the cold run"
    # Bytes: the store against a DynamicCache that ran the stored tokens.
    with torch.no_grad():
        kwarg = store._store.profile.cache_kwarg
        dyn = model(stored, **{kwarg: DynamicCache(config=model.config)}, use_cache=True)
    dyn_cache = dyn.cache_params if kwarg == "cache_params" else dyn.past_key_values
    dyn_nbytes = _dynamic_cache_nbytes(dyn_cache)
    store.clear()
    store.reset_stats()
    generate(model, turn1, 4, past_key_values=store)
    stats = store.stats()
    config = model.config
    if name == "mamba-130m":
        # Recurrent state only: each snapshot (prompt end, answer end) is one DynamicCache's worth.
        assert stats.nbytes == stats.snapshots * dyn_nbytes and stats.snapshots >= 1
    elif name == "gemma-3-1b":
        # Sliding layers are stored at every position (see docs/structure.md, memory rules); the model's
        # own cache keeps the last window - 1 of them.
        per_layer_token = 2 * config.num_key_value_heads * config.head_dim * 2
        num_sliding = config.layer_types.count("sliding_attention")
        kept = GEMMA3_WINDOW - 1
        assert stats.nbytes == dyn_nbytes + num_sliding * per_layer_token * (stored.shape[1] - kept)
        assert stats.nbytes == stored.shape[1] * _kv_nbytes_per_token(config, torch.bfloat16)
    else:
        assert stats.nbytes == dyn_nbytes == stored.shape[1] * _kv_nbytes_per_token(config, torch.bfloat16)
    store.detach()
