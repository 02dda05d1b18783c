"""A prefix brought back from host memory lands layer by layer while the prefill runs, and stays exact.

On the CPU each block of layers is copied at its first `ready` (`DeferredCopies`); until then its
memory holds NaN, so a reader that does not wait shows up as wrong logits, as it would on a GPU.
"""

from __future__ import annotations

from typing import Any, TypeVar

import pytest
import torch
from conftest import assert_same_as_cold, cached_model, distinct_prompt, generate
from transformers import DynamicCache

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.keys.prefix_key import PrefixKey
from hf_prefix_cache.model.landing import DeferredCopies, Landing
from hf_prefix_cache.model.runs import Run
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.storage import segments
from hf_prefix_cache.storage.mover import Mover, _layer_blocks, segment_to_device, segment_to_host
from hf_prefix_cache.storage.segments import Segment
from hf_prefix_cache.storage.tiers import DEVICE, HOST

L = TypeVar("L", bound=Landing)


def _segment(num_layers: int, length: int = 5) -> Segment:
    keys = [torch.randn(1, 2, length, 4) for _ in range(num_layers)]
    values = [torch.randn(1, 2, length, 4) for _ in range(num_layers)]
    run = Run(list(keys), list(values), 0, length)
    run.take()
    return Segment(run, 0, length, run.nbytes_per_token, {})


def _made(monkeypatch: Any, cls: type[L]) -> list[L]:
    """Every instance of `cls` (a kind of landing) made from now on."""
    made: list[L] = []
    original = cls.__init__

    def record(self: L, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(cls, "__init__", record)
    return made


def test_a_run_back_from_the_host_lands_block_by_block() -> None:
    """Brought back, a run's keys are unwritten (NaN) until their block lands; `slice` lands them all."""
    mover = Mover()
    seg = _segment(num_layers=3)
    assert seg.run is not None
    host = segment_to_host(seg, mover)
    back = segment_to_device(host, mover, {})
    assert back.run is not None and isinstance(back.run.landing, DeferredCopies)
    landing = back.run.landing
    assert all(torch.isnan(k).all() for k in back.run.keys)  # nothing copied yet
    landing.ready(1)
    assert torch.equal(back.run.keys[1], seg.run.keys[1]) and torch.equal(back.run.values[1], seg.run.values[1])
    assert torch.isnan(back.run.keys[0]).all() and torch.isnan(back.run.keys[2]).all()
    assert landing.order == [1] and not landing.landed
    keys, values = back.run.slice(0, 5)  # any other reader lands everything first
    assert all(torch.equal(a, b) for a, b in zip(keys, seg.run.keys, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(values, seg.run.values, strict=True))
    assert landing.landed and back.run.landing is None


def test_layers_are_grouped_into_at_most_sixteen_copies_in_byte_order() -> None:
    """40 layers go in 14 copies of 3 layers (the last of 1); the ranges tile the buffer in order."""
    host = segment_to_host(_segment(num_layers=40), Mover())
    assert host.run is not None
    tensors = [t for pair in zip(host.run.keys, host.run.values, strict=True) for t in pair]
    blocks = _layer_blocks(tensors, [i for i in range(40) for _ in (0, 1)])
    assert blocks is not None
    block_of, ranges = blocks
    assert len(ranges) == 14 and block_of[0] == block_of[2] == 0 and block_of[3] == 1 and block_of[39] == 13
    assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
    assert ranges[-1][1] == sum(t.nbytes for t in tensors)
    # Keys of every layer before any value (a layout whose blocks would not be ranges): not by layer.
    seg = _segment(num_layers=40)
    assert seg.run is not None
    keys_first, _ = Mover().to_host(seg.run.keys + seg.run.values)
    assert _layer_blocks(keys_first, list(range(40)) * 2) is None  # type: ignore[arg-type]


def test_a_layout_not_in_layer_order_is_copied_at_once() -> None:
    """Tensors whose bytes are not in layer order come back whole, with nothing left to land."""
    seg = _segment(num_layers=3)
    assert seg.run is not None
    mover = Mover()
    keys_first, _ = mover.to_host(seg.run.keys + seg.run.values)
    moved, landing = mover.to_device_by_layer(keys_first, [None] * 6, [0, 1, 2, 0, 1, 2])
    assert landing is None
    assert all(torch.equal(a, b) for a, b in zip(moved, seg.run.keys + seg.run.values, strict=True))  # type: ignore[arg-type]


def _first_use_restores(monkeypatch: Any) -> list[tuple[int, int, int]]:
    """(pieces, landings, batch size) of every restore set layer by layer at first use from now on."""
    seen: list[tuple[int, int, int]] = []
    original = WorkingCache._restore_landing

    def record(self: WorkingCache, length: int, pieces: Any, landings: Any, batch_size: int) -> None:
        seen.append((len(pieces), len(landings), batch_size))
        original(self, length, pieces, landings, batch_size)

    monkeypatch.setattr(WorkingCache, "_restore_landing", record)
    return seen


def _host_hit_store(model: Any, ids: torch.Tensor) -> PrefixCache:
    store = PrefixCache(model, max_host_bytes="64MB")
    generate(model, ids, past_key_values=store)
    store._store.relieve_device()
    tree = store._store._tree
    assert tree.match(store._store.namespace(), ids[0].tolist()).path[-1].tier == HOST
    return store


def test_the_prefill_waits_only_for_its_own_layer(monkeypatch: Any) -> None:
    """Layer i's first update finds its own block landed and the later ones still on their way."""
    llama = cached_model("llama")
    ids = distinct_prompt(41)
    store = _host_hit_store(llama, ids)
    made = _made(monkeypatch, DeferredCopies)
    seen: list[tuple[int, list[int]]] = []
    original_update = DynamicCache.update

    def update(self: Any, key_states: Any, value_states: Any, layer_idx: int, *args: Any, **kwargs: Any) -> Any:
        if made and len(seen) < llama.config.num_hidden_layers:
            seen.append((layer_idx, list(made[0].order)))
        return original_update(self, key_states, value_states, layer_idx, *args, **kwargs)

    monkeypatch.setattr(DynamicCache, "update", update)
    try:
        before = store.stats().hit_tokens
        assert_same_as_cold(llama, ids, store)
        assert store.stats().hit_tokens - before == ids.shape[1] - 1
        assert len(made) == 1
        # One layer per block here: at layer i's first update, exactly blocks 0..i have landed.
        assert seen == [(i, list(range(i + 1))) for i in range(llama.config.num_hidden_layers)]
        assert store._store._tree.match(store._store.namespace(), ids[0].tolist()).path[-1].tier == DEVICE
        store.check_integrity()
    finally:
        store.detach()


def test_a_prefix_partly_on_the_device_joins_its_pieces_at_first_use() -> None:
    """A stored prefix whose head stayed on the device and whose tail came back from the host is exact."""
    llama = cached_model("llama")
    head = distinct_prompt(42)
    store = PrefixCache(llama, max_host_bytes="64MB")
    try:
        generate(llama, head, past_key_values=store)
        longer = torch.cat([head, distinct_prompt(43)[:, :12]], dim=1)
        generate(llama, longer, past_key_values=store)
        tree, namespace = store._store._tree, store._store.namespace()
        path = tree.match(namespace, longer[0].tolist()).path
        assert len(path) >= 2
        store._store._placement.move(path[-1], HOST)  # only the tail leaves the device
        before = store.stats().hit_tokens
        assert_same_as_cold(llama, longer, store)
        assert store.stats().hit_tokens - before == longer.shape[1] - 1
        store.check_integrity()
    finally:
        store.detach()


@pytest.mark.parametrize(
    "call",
    [
        lambda cache: cache.batch_repeat_interleave(2),
        lambda cache: cache.crop(-3),  # drop the last 3 positions (both releases read it so)
        lambda cache: cache.reorder_cache(torch.zeros(1, dtype=torch.long)),
        lambda cache: list(cache),
        lambda cache: cache.capture_run(cache.get_seq_length()),
    ],
    ids=["batch_repeat_interleave", "crop", "reorder_cache", "iteration", "capture_run"],
)
def test_other_cache_methods_land_every_layer_first(call: Any) -> None:
    """Whatever reads the restored cache other than a layer's own update finds every layer landed and exact."""
    llama = cached_model("llama")
    ids = distinct_prompt(44)
    store = _host_hit_store(llama, ids)
    try:
        tree_store, tokens = store._store, ids[0].tolist()
        landing = tree_store.new_cache()
        lease = tree_store.acquire(PrefixKey(tree_store.namespace(), tokens), landing, overlap=True)
        assert all(torch.isnan(layer.keys).all() for layer in landing.layers)  # stand-ins until first use
        call(landing)
        landed = [(layer.keys.clone(), layer.values.clone()) for layer in landing.layers]  # before anything else lands
        tree_store.release(lease)
        eager = tree_store.new_cache()
        lease = tree_store.acquire(PrefixKey(tree_store.namespace(), tokens), eager)
        call(eager)
        tree_store.release(lease)
        assert "update" not in vars(landing) and "crop" not in vars(landing)  # the waiting methods are gone
        for (keys, values), b in zip(landed, eager.layers, strict=True):
            assert torch.equal(keys, b.keys) and torch.equal(values, b.values)
    finally:
        store.detach()


def test_a_prefix_in_two_runs_on_the_device_is_joined_by_the_first_update(monkeypatch: Any) -> None:
    """A prefix across two runs (a branch that continues) is not joined before the prefill: each layer's first
    update joins it with the new keys in one concatenation, and the hit is exact."""
    llama = cached_model("llama")
    system = distinct_prompt(52)
    first = torch.cat([system, distinct_prompt(53, n=10)], 1)
    second = torch.cat([system, distinct_prompt(54, n=10)], 1)
    store = PrefixCache(llama)

    def no_join(pieces: Any) -> Any:
        assert len(pieces) == 1, "pieces joined before the prefill"
        return pieces[0]

    try:
        generate(llama, first, past_key_values=store)
        generate(llama, second, past_key_values=store)  # its own tokens in a run of their own
        restores = _first_use_restores(monkeypatch)
        monkeypatch.setattr(segments, "join_kv", no_join)
        longer = torch.cat([second, distinct_prompt(55, n=6)], 1)
        before = store.stats().hit_tokens
        assert_same_as_cold(llama, longer, store)
        assert store.stats().hit_tokens - before == second.shape[1]
        assert restores == [(2, 0, 1)]
        store.check_integrity()
    finally:
        store.detach()


def test_identical_batch_rows_with_a_prefix_from_the_host_are_exact(monkeypatch: Any) -> None:
    """Identical rows get their stored prefix from the host broadcast to every row, each layer at its first use
    (rows that differ restore one by one: tests/hooks/test_batches.py)."""
    llama = cached_model("llama")
    system = distinct_prompt(47)
    store = _host_hit_store(llama, system)
    restores = _first_use_restores(monkeypatch)
    try:
        question = distinct_prompt(48, n=8)
        question[0, 0] = 100
        rows = [torch.cat([system, question], 1)] * 3
        before = store.stats().hit_tokens
        assert_same_as_cold(llama, torch.cat(rows), store)
        assert store.stats().hit_tokens - before == 3 * system.shape[1]
        assert restores == [(1, 1, 3)]
        store.check_integrity()
    finally:
        store.detach()


def test_a_hybrid_lands_everything_before_its_restore() -> None:
    """A model with recurrent layers cannot set layers at first use: its copies land first, and it stays exact."""
    bamba = cached_model("bamba")
    ids = distinct_prompt(45)
    store = _host_hit_store(bamba, ids)
    try:
        before = store.stats().hit_tokens
        assert_same_as_cold(bamba, ids, store)
        assert store.stats().hit_tokens > before
    finally:
        store.detach()


def test_lookup_hands_out_landed_keys() -> None:
    """`lookup` gives the user a cache to read as they like: every layer has landed."""
    llama = cached_model("llama")
    ids = distinct_prompt(46)
    store = _host_hit_store(llama, ids)
    try:
        with store.lookup(ids) as hit:
            assert hit.cached_len == ids.shape[1] - 1
            for layer in hit.cache.layers:
                assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()
    finally:
        store.detach()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_copies_land_on_a_side_stream_and_the_hit_is_exact(monkeypatch: Any) -> None:
    """A 4,000-token prefix from page-locked memory lands by events on a side stream; greedy tokens and logits match cold.

    The copies take milliseconds here, so a layer read before its event would read the
    memory's previous contents.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_prefix_cache.model.landing import StreamEvents

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=8192,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to("cuda").eval()
    ids = torch.randint(4, 512, (1, 4000), device="cuda")
    store = PrefixCache(model, max_host_bytes="4GB")
    made = _made(monkeypatch, StreamEvents)
    try:
        generate(model, ids[:, :-32], past_key_values=store)
        for rep in range(3):
            store._store.relieve_device()
            prompt = ids.clone()
            prompt[0, -32] = 5 + rep  # a new suffix each time: the hit is the stored prefix
            before = store.stats().hit_tokens
            assert_same_as_cold(model, prompt, store)
            assert store.stats().hit_tokens - before == 4000 - 32
        assert len(made) >= 3 and all(len(landing.events) == 8 for landing in made)  # one block per layer
        store.check_integrity()
    finally:
        store.detach()
