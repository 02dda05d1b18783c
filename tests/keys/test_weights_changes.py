"""The namespace follows the weights and adapters the model holds now, noticed at the next request."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import Hits, assert_same_as_cold, build, distinct_prompt

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.tiny_build import _finalize


def _scale_lm_head(model: Any) -> None:
    model.lm_head.weight.data.add_(1)


def _scale_a_layer(model: Any) -> None:
    p = model.model.layers[0].self_attn.q_proj.weight
    p.data.mul_(1.5)


def _replace_data(model: Any) -> None:
    p = model.model.layers[1].mlp.up_proj.weight
    p.data = p.data * 1.1


def _load_state_dict(model: Any) -> None:
    state = {k: v * 1.01 for k, v in model.state_dict().items()}
    model.load_state_dict(state)


def _no_grad_update(model: Any) -> None:
    with torch.no_grad():
        model.model.norm.weight.add_(0.5)


EDITS: dict[str, Callable[[Any], None]] = {
    "data_add_lm_head": _scale_lm_head,
    "data_mul": _scale_a_layer,
    "data_assign": _replace_data,
    "load_state_dict": _load_state_dict,
    "no_grad_inplace": _no_grad_update,
}


def _transpose_data(model: Any) -> None:
    # Same storage, same version counter: only the recorded `.data` assignment and the layout show it.
    p = model.model.layers[0].self_attn.o_proj.weight
    p.data = p.detach().t()


def _swap_tensors(model: Any) -> None:
    # The replacement's version counter made equal to the parameter's, so only the recorded swap shows it.
    p = model.model.layers[1].self_attn.q_proj.weight
    other = torch.nn.Parameter(p.detach() * 1.5)
    with torch.no_grad():
        while other._version < p._version:
            other.mul_(1.0)
    torch.utils.swap_tensors(p, other)


def _parameters_write(model: Any) -> None:
    module = model.model.layers[0].mlp.gate_proj
    module._parameters["weight"] = torch.nn.Parameter(module.weight.detach() * 1.1)


def _load_state_dict_assign(model: Any) -> None:
    state = {k: v * 1.01 for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)


def _to_float64(model: Any) -> None:
    model.to(torch.float64)


def _to_float64_swapping(model: Any) -> None:
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)  # `_apply` swaps each parameter in place
    try:
        model.to(torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)


REPLACEMENTS: dict[str, Callable[[Any], None]] = {
    "data_assign_transposed_view": _transpose_data,
    "swap_tensors_same_version": _swap_tensors,
    "parameters_dict_write": _parameters_write,
    "load_state_dict_assign": _load_state_dict_assign,
    "to_float64": _to_float64,
    "to_float64_swapping": _to_float64_swapping,
}


@pytest.mark.parametrize("edit", sorted({**EDITS, **REPLACEMENTS}))
def test_weights_edited_or_replaced_are_never_served_stale_states(edit: str) -> None:
    """After an edit of the weights (through `.data` too), or a parameter replaced or its storage or layout swapped
    under it, the next request runs cold and exact, then reuses again."""
    model = build("llama")
    store = PrefixCache(model)
    hits = Hits(store)
    ids = distinct_prompt(5 if edit in REPLACEMENTS else 1)
    assert_same_as_cold(model, ids, store)
    assert_same_as_cold(model, ids, store)
    assert hits.last() == ids.shape[1] - 1
    {**EDITS, **REPLACEMENTS}[edit](model)
    assert_same_as_cold(model, ids, store)
    assert hits.last() == 0
    assert_same_as_cold(model, ids, store)
    assert hits.last() == ids.shape[1] - 1


def test_invalidate_forgets_an_edit_too_small_to_see() -> None:
    """`invalidate()` drops every entry, so an edit of one embedding row the probe may miss is never served stale."""
    model = build("llama")
    store = PrefixCache(model)
    hits = Hits(store)
    ids = distinct_prompt(2)
    assert_same_as_cold(model, ids, store)
    model.model.embed_tokens.weight.data[int(ids[0, 5])] += 1.0
    store.invalidate()
    assert store.stats().entries == 0
    assert_same_as_cold(model, ids, store)
    assert hits.last() == 0


def _checkpoint(tmp_path: Path, seed: int) -> tuple[Path, Any]:
    source = build("llama")  # seeds 0 itself
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in source.parameters():
            p.normal_(0, 0.2)
    folder = tmp_path / f"weights{seed}"
    source.save_pretrained(folder)
    return folder, source.config


def _load_to_empty(folder: Path, config: Any) -> tuple[Any, Callable[[], None]]:
    from safetensors.torch import load_file

    with torch.device("meta"):
        model = type(build("llama"))(config)

    def load() -> None:
        model.to_empty(device="cpu")
        state = load_file(str(folder / "model.safetensors"))
        model.load_state_dict(state, strict=False)
        model.tie_weights()
        with torch.no_grad():  # non-persistent buffers (rotary frequencies) are not in the checkpoint
            for name, buffer in build("llama").named_buffers():
                model.get_buffer(name).copy_(buffer)
        _finalize(model)

    return model, load


def _load_accelerate(folder: Path, config: Any) -> tuple[Any, Callable[[], None]]:
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch

    with init_empty_weights():
        model = type(build("llama"))(config)

    def load() -> None:
        load_checkpoint_and_dispatch(model, str(folder), device_map={"": "cpu"})
        _finalize(model)

    return model, load


@pytest.mark.parametrize("loader", ["to_empty", "accelerate"])
def test_store_built_before_the_weights_are_loaded_follows_them(tmp_path: Path, loader: str) -> None:
    """Two weight sets loaded into models built on meta (store made first) never share entries or disk files."""
    make = _load_to_empty if loader == "to_empty" else _load_accelerate
    disk = tmp_path / "cache"
    ids = distinct_prompt(3, 40)
    outputs = []
    for seed in (1, 2):
        folder, config = _checkpoint(tmp_path, seed)
        model, load = make(folder, config)
        store = PrefixCache(model, disk_dir=disk, save_on_exit=False)
        load()
        hits = Hits(store)
        outputs.append(assert_same_as_cold(model, ids, store).sequences)
        assert hits.last() == 0, f"weights {seed} reused another weight set's states"
        assert_same_as_cold(model, ids, store)
        assert hits.last() == ids.shape[1] - 1
        store.save()
        store.detach()
    assert not torch.equal(outputs[0], outputs[1]), "the two weight sets should answer differently"
    assert len({p.parent for p in disk.rglob("*.safetensors")}) == 2


def _peft_pair(wrap: str) -> tuple[Any, Any, Any]:
    """(PeftModel, the model the store wraps, its LoRA config maker) for `outer` or `inner` wrapping."""
    peft = pytest.importorskip("peft")

    def config() -> Any:
        return peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)

    peft_model = peft.get_peft_model(build("llama"), config())
    target = peft_model if wrap == "outer" else peft_model.base_model.model
    return peft_model, target, config


@pytest.mark.parametrize("wrap", ["outer", "inner"])
def test_peft_adapters_switching_disabling_merging_and_unloading(wrap: str) -> None:
    """A store on a PeftModel or on the model inside it reuses only states of the adapters active now."""
    peft_model, target, config = _peft_pair(wrap)
    store = PrefixCache(target)
    hits = Hits(store)
    ids = distinct_prompt(4)
    full = ids.shape[1] - 1
    steps: list[tuple[str, Callable[[], None], int]] = [
        ("first", lambda: None, 0),
        ("repeat", lambda: None, full),
        ("add b", lambda: peft_model.add_adapter("b", config()), 0),
        ("switch to b", lambda: peft_model.set_adapter("b"), 0),
        ("back to default", lambda: peft_model.set_adapter("default"), full),
        ("merge", peft_model.merge_adapter, 0),
        ("repeat merged", lambda: None, full),
        ("unmerge", peft_model.unmerge_adapter, None),
    ]
    for name, step, expected in steps:
        step()
        assert_same_as_cold(target, ids, store)
        hit = hits.last()
        assert expected is None or hit == expected, f"{name}: {hit} hit tokens, expected {expected}"
    with peft_model.disable_adapter():
        assert_same_as_cold(target, ids, store)
        assert hits.last() == 0, "disabled adapters reused the adapted states"
    assert_same_as_cold(target, ids, store)
    assert hits.last() == full
    if wrap == "inner":
        base = peft_model.unload()
        assert base is target
        assert_same_as_cold(target, ids, store)
        assert hits.last() == 0, "unloaded adapters reused the adapted states"
    assert store.stats().fallbacks == {}
    store.detach()
