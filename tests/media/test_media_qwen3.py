"""Qwen3.5 (dense, MoE; hybrid recurrent text layers), Qwen3-VL-MoE, Cohere Compass and Cosmos 3 Omni serve media exactly.

Every request runs cold and through the store: equal tokens, logits within 1e-4. Qwen3.5's
gated delta-net layers hold recurrent states: the hook prefills media prompts itself, fed the
embeddings the forward computes, at the prompt's M-RoPE positions, and restores only where a
snapshot was taken (prompt end, answer end, divergence).
"""

from __future__ import annotations

import torch
from conftest import generate

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.multimodal.qwen_vl import Qwen3_5Media, Qwen3VLMedia
from hf_prefix_cache.testing.media import harness
from hf_prefix_cache.testing.media.harness import NEW
from hf_prefix_cache.testing.media.qwen3 import FAMILIES, HYBRID, Qwen3Family
from hf_prefix_cache.testing.tiny_qwen_media import EncoderCalls
from hf_prefix_cache.testing.tiny_vlm_media import text
from media.conftest import family_fixture

family = family_fixture(Qwen3Family, FAMILIES)


def test_each_family_gets_its_adapter() -> None:
    """Qwen3.5 computes suffix embeddings for its recurrent prefill; the deepstack families take Qwen3-VL's."""
    for name in HYBRID:
        adapter = media_adapter_for(Qwen3Family(name).model)
        assert type(adapter) is Qwen3_5Media and adapter.embeds_suffix
    for name in ("qwen3_vl_moe", "cohere_compass", "cosmos3_omni"):
        assert type(media_adapter_for(Qwen3Family(name).model)) is Qwen3VLMedia, name


def test_only_suffix_media_reach_the_tower(family: tuple[Qwen3Family, PrefixCache]) -> None:
    """After a cached image, the vision tower encodes only the new image's patch rows."""
    fam, store = family
    old, new = fam.image(1), fam.image(2)
    first = torch.cat([text(3, 1), fam.placeholders(old), text(3, 2)], dim=1)
    harness.check(fam.model, first, store, fam.kwargs(first, [old]))
    second = torch.cat([first, text(2, 4), fam.placeholders(new), text(2, 5)], dim=1)
    with EncoderCalls(fam.model, {"vision": "visual"}) as calls:
        generate(fam.model, second, NEW, past_key_values=store, **fam.kwargs(second, [old, new]))
    t, h, w = new.grid
    assert calls.total("vision") == t * h * w
