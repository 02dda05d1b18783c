"""The media registry: one row per family, and everything that names families reads it.

The adapter lookup, `MEDIA_KWARGS` (what the hook refuses for a model whose adapter does not
handle it), the cold families and the test builders all derive from the rows the family modules
register; these tests check the registry's own rules, cheaply, without running a model.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hf_prefix_cache.multimodal import MEDIA_KWARGS, registry
from hf_prefix_cache.multimodal.base import SHARED_MEDIA_KWARGS
from hf_prefix_cache.multimodal.qwen_vl import Qwen2VLMedia
from hf_prefix_cache.testing.media import registry as builders


def test_a_key_served_twice_is_refused_with_its_name() -> None:
    with pytest.raises(ValueError, match="qwen2_vl"):
        registry.register(registry.MediaFamily(("qwen2_vl",), Qwen2VLMedia))
    assert registry.family("qwen2_vl").adapter is Qwen2VLMedia


def test_a_row_has_an_adapter_or_a_cold_reason_not_both() -> None:
    with pytest.raises(AssertionError):
        registry.MediaFamily(("new_type",), Qwen2VLMedia, cold="both")
    with pytest.raises(AssertionError):
        registry.MediaFamily(("new_type",), None)


def test_an_unregistered_key_names_itself() -> None:
    with pytest.raises(KeyError, match="not_a_family"):
        registry.family("not_a_family")


def test_a_tower_key_wins_over_its_model_type() -> None:
    pixtral = SimpleNamespace(model_type="llava", vision_config=SimpleNamespace(model_type="pixtral"))
    clip = SimpleNamespace(model_type="llava", vision_config=SimpleNamespace(model_type="clip_vision_model"))
    assert registry.family_key(pixtral) == "llava/pixtral"
    assert registry.family_key(clip) == "llava"
    assert registry.family_key(SimpleNamespace(model_type="llama")) is None


def test_media_kwargs_are_the_shared_ones_then_each_familys_own() -> None:
    assert MEDIA_KWARGS[: len(SHARED_MEDIA_KWARGS)] == SHARED_MEDIA_KWARGS
    own = {name for row in registry.FAMILIES.values() for name in row.kwargs}
    assert own and own <= set(MEDIA_KWARGS) and len(set(MEDIA_KWARGS)) == len(MEDIA_KWARGS)
    assert registry.family("kosmos-2.5").kwargs == ("flattened_patches", "image_embeds_position_mask")


def test_cold_families_have_no_adapter_and_are_not_served() -> None:
    cold = registry.cold()
    assert set(cold) == {"minicpmv4_6", "git", "molmo2", "qwen4_exp"}
    assert not set(cold) & set(registry.served())


def test_every_test_builder_is_keyed_by_a_served_family() -> None:
    served = set(registry.served())
    assert set(builders.sweep_cases()) <= served
    assert set(builders.suite_cases()) <= served
