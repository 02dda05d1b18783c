"""The weights probe reads the device only for parameters an unversioned alias may have written, and misses none."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from conftest import build

from hf_prefix_cache.keys import weights
from hf_prefix_cache.keys.weights import WeightsProbe


@pytest.fixture
def model() -> Any:
    return build("llama")


def _steady(model: Any) -> WeightsProbe:
    probe = WeightsProbe(model)
    probe.check()
    probe.check()
    return probe


def test_a_steady_check_samples_no_parameter(model: Any) -> None:
    """Without an alias taken or alive, a check reads nothing on the device, generate calls between included."""
    probe = _steady(model)
    before = probe.check()
    model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2)
    assert probe.check() == before
    assert probe.num_sampled == 0


def test_reading_data_samples_that_parameter_and_counts_no_change(model: Any) -> None:
    """A `.data` read makes the next check sample its parameter only, and a read alone changes nothing."""
    probe = _steady(model)
    before = probe.check()
    _ = model.lm_head.weight.data.sum()
    assert probe.check() == before
    assert probe.num_sampled == 1
    probe.check()
    assert probe.num_sampled == 0


def test_an_alias_held_across_checks_is_sampled_until_dropped(model: Any) -> None:
    """A `.data` alias taken before a check and written after it is still seen; once dropped, sampling stops."""
    probe = _steady(model)
    alias = model.model.layers[0].mlp.down_proj.weight.data
    before = probe.check()
    assert probe.check() == before
    alias.mul_(2)
    assert probe.check() == before + 1
    del alias
    probe.check()
    probe.check()
    assert probe.num_sampled == 0


def test_an_alias_alive_when_the_probe_is_made_is_sampled(model: Any) -> None:
    """An alias taken before the probe existed, and written later, is seen (its storage is shared)."""
    alias = model.model.norm.weight.data
    probe = _steady(model)
    before = probe.check()
    alias.add_(1)
    assert probe.check() == before + 1


@pytest.mark.parametrize("route", ["numpy", "dlpack"])
def test_writes_through_numpy_and_dlpack_aliases_are_seen(model: Any, route: str) -> None:
    """A write through a NumPy or DLPack alias (no version counter) is seen, even after the alias is dropped."""
    probe = _steady(model)
    before = probe.check()
    p = model.model.layers[1].self_attn.o_proj.weight
    if route == "numpy":
        array = p.detach().numpy()
        array *= np.float32(3.0)
    else:
        torch.from_dlpack(p.detach().__dlpack__()).mul_(3.0)
    del p
    assert probe.check() == before + 1


def test_two_probes_of_one_model_both_see_an_edit(model: Any) -> None:
    """An alias record is not consumed by the first probe that reads it."""
    first, second = _steady(model), _steady(model)
    counts = first.check(), second.check()
    model.lm_head.weight.data.add_(1)
    assert first.check() == counts[0] + 1
    assert second.check() == counts[1] + 1


def test_a_full_alias_record_makes_every_probe_sample_everything(model: Any, monkeypatch: Any) -> None:
    """When the record of aliased storages restarts, the next check samples every parameter once."""
    probe = _steady(model)
    monkeypatch.setattr(weights, "_ALIAS_LIMIT", 2)
    for _ in range(3):
        _ = torch.zeros(4).data
    before = probe.check()
    assert probe.num_sampled == len(list(model.parameters()))
    assert probe.check() == before
    assert probe.num_sampled == 0


def test_data_is_still_assignable_and_aliases_share_storage() -> None:
    """The `.data` property keeps torch's behaviour: an alias without autograd history, and assignment."""
    p = torch.nn.Parameter(torch.ones(3))
    alias = p.data
    assert alias.data_ptr() == p.data_ptr() and not alias.requires_grad
    p.data = torch.zeros(3)
    assert torch.equal(p.detach(), torch.zeros(3))


def test_a_data_assignment_that_keeps_storage_and_layout_counts_no_change(model: Any) -> None:
    """`p.data = p.detach()` is recorded, compared, and found the same: the store keeps reusing."""
    probe = _steady(model)
    before = probe.check()
    p = model.lm_head.weight
    p.data = p.detach()
    assert probe.check() == before
    p.data = p.detach().t().t()
    assert probe.check() == before
    p.data = p.detach().t()
    assert probe.check() == before + 1


def test_a_storage_reallocated_in_place_keeps_its_aliases_seen(model: Any) -> None:
    """A storage moved under its parameter (new pointer, same values) still has its `.data` edits seen."""
    probe = _steady(model)
    p = model.lm_head.weight
    p.untyped_storage().resize_(p.untyped_storage().nbytes() * 2)  # reallocates, keeping the values
    before = probe.check()
    p.data.add_(1)
    assert probe.check() == before + 1
