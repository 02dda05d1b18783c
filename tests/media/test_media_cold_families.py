"""Multimodal families examined and left cold on media, and media kwargs a served family cannot key: their media
requests run cold, equal to cold runs, with the reason counted.

* Molmo 2 (`COLD_FAMILIES`): the processor's `mm_token_type_ids` put every image placeholder of a prompt in
  one bidirectional attention block, so an image's states change with the images after it.
* Qwen4-Exp (`COLD_FAMILIES`): 4-row M-RoPE positions, gated delta-net layers and an indexer keeping positions
  need an adapter of its own; its media requests run cold.
* Step 3.7's local crops (`pixel_values_local`, a variable number per image) are no whole rows of one kwarg:
  calls passing them run cold, while its global views alone are served (`test_media_generic.py`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import transformers
from conftest import assert_same_as_cold

from hf_prefix_cache.multimodal import media_adapter_for, registry
from hf_prefix_cache.testing.media.generic_downsampled import tiny_step3p7
from hf_prefix_cache.testing.media.generic_ids import IMG
from hf_prefix_cache.testing.media.harness import served
from hf_prefix_cache.testing.tiny_attention import tiny_qwen4_exp
from hf_prefix_cache.testing.tiny_vlm_media import run, text
from hf_prefix_cache.testing.tiny_vlm_parts import _QWEN_IDS, _QWEN_TOWER, _TEXT, _build


def _fallbacks(model: Any, ids: torch.Tensor, **kwargs: Any) -> dict[str, int]:
    """Run `ids` twice through a store, each equal to its cold run; the store's fallbacks (it reused nothing)."""
    with served(model, clean=False) as store:
        for _ in range(2):
            assert_same_as_cold(model, ids, store, new=3, **kwargs)
        assert store.stats().hit_tokens == 0
        return store.stats().fallbacks


@functools.cache
def tiny_molmo2() -> Any:
    """Molmo 2: a ViT on 16 patches of 2x2 pixels per crop, an attention pool of 4 patches per placeholder."""
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 8,
        "image_size": [8, 8],
        "patch_size": 2,
        "num_position_embeddings": 16,
    }
    adapter = {
        "vision_feature_layer": [-1],
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 8,
        "intermediate_size": 64,
        "text_hidden_size": 64,
    }
    config = transformers.Molmo2Config(
        text_config={**_TEXT, "head_dim": 16}, vision_config=vision, adapter_config=adapter, image_patch_id=IMG
    )
    return _build(transformers.Molmo2ForConditionalGeneration, config)


def molmo2_kwargs(ids: torch.Tensor, seeds: list[int]) -> dict[str, Any]:
    """What Molmo 2's processor hands `generate` for one crop per image: 4 placeholders, each pooling 4 patches."""
    crops = [torch.rand(16, 12, generator=torch.Generator().manual_seed(s)) for s in seeds]
    return {
        "pixel_values": torch.stack(crops),
        "image_token_pooling": torch.arange(16).view(4, 4).repeat(len(seeds), 1),
        "image_grids": torch.tensor([[2, 2, 0, 0]] * len(seeds)),
        "image_num_crops": torch.ones(len(seeds), dtype=torch.long),
        "mm_token_type_ids": (ids == IMG).long(),
    }


def test_a_molmo2_image_attends_to_the_images_after_it() -> None:
    """The first image's placeholders' hidden states differ when a second image follows it: no per-item prefix."""
    model = tiny_molmo2()
    first = torch.cat([text(3, 1), run(IMG, 4), text(2, 2)], dim=1)
    both = torch.cat([first, run(IMG, 4), text(2, 3)], dim=1)
    with torch.no_grad():
        alone = model(first, **molmo2_kwargs(first, [1])).logits[0, 3:7]
        followed = model(both, **molmo2_kwargs(both, [1, 2])).logits[0, 3:7]
    assert (alone - followed).abs().max() > 1e-3


def test_molmo2_keeps_no_adapter_and_its_media_run_cold() -> None:
    model = tiny_molmo2()
    assert media_adapter_for(model) is None and "molmo2" in registry.cold()
    ids = torch.cat([text(4, 1), run(IMG, 4), text(4, 2)], dim=1)
    assert _fallbacks(model, ids, **molmo2_kwargs(ids, [1])) == {"media_inputs:molmo2": 2}


def test_step3p7_local_crops_run_cold() -> None:
    """An image with two local crops (their 2 x 16 placeholders, then its global view's 16) runs cold."""
    model = tiny_step3p7()
    ids = torch.cat([text(4, 1), run(IMG, 48), text(4, 2)], dim=1)
    gen = torch.Generator().manual_seed(1)
    kwargs = {
        "pixel_values": torch.rand(1, 3, 32, 32, generator=gen),
        "pixel_values_local": torch.rand(2, 3, 32, 32, generator=gen),
        "num_local_patches": [2],
    }
    assert _fallbacks(model, ids, **kwargs) == {"media_inputs:pixel_values_local": 2}


def test_qwen4_exp_keeps_no_adapter_and_its_media_run_cold() -> None:
    """Qwen4-Exp (the tiny text model's layers, a Qwen3-VL-style tower): an image request runs cold, counted."""
    text_config = {
        k: v for k, v in tiny_qwen4_exp().config.to_dict().items() if k not in ("architectures", "model_type")
    }
    vision = {"depth": 2, **_QWEN_TOWER, "num_position_embeddings": 64}
    config = transformers.Qwen4ExpConfig(text_config=text_config, vision_config=vision, **_QWEN_IDS)
    model = _build(transformers.Qwen4ExpForConditionalGeneration, config)
    assert media_adapter_for(model) is None and "qwen4_exp" in registry.cold()
    ids = torch.cat([text(4, 1), torch.tensor([[122, *[IMG] * 6, 123]]), text(4, 2)], dim=1)
    kwargs = {
        "pixel_values": torch.rand(24, 3 * 2 * 2 * 2, generator=torch.Generator().manual_seed(1)),
        "image_grid_thw": torch.tensor([[1, 4, 6]]),
        "mm_token_type_ids": (ids == IMG).long(),
    }
    assert _fallbacks(model, ids, **kwargs) == {"mrope_positions": 2}  # its M-RoPE is refused first
