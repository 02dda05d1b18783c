"""Media requests the store cannot serve exactly run cold, with the reason counted."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import transformers
from conftest import assert_same_as_cold, generate

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.multimodal import registry
from hf_prefix_cache.testing.media.generic_images import tiny_vipllava
from hf_prefix_cache.testing.media.harness import served
from hf_prefix_cache.testing.tiny_processors import llava_next_processor
from hf_prefix_cache.testing.tiny_vlm_media import llava_next_tokens, llava_pixels, pil_image, run, text
from hf_prefix_cache.testing.tiny_vlm_parts import _TEXT, IMAGE_ID, _build
from hf_prefix_cache.testing.tiny_vlms import cached_vlm


def _fallbacks(model: Any, ids: torch.Tensor, **kwargs: Any) -> dict[str, int]:
    with served(model, clean=False) as store:
        for _ in range(2):
            assert_same_as_cold(model, ids, store, new=3, **kwargs)
        assert store.stats().hit_tokens == 0
        return store.stats().fallbacks


def test_family_without_a_media_adapter_runs_cold(monkeypatch: pytest.MonkeyPatch) -> None:
    """A family with no media adapter (VipLLaVA with its table row taken away) runs cold as `media_inputs:<type>`."""
    monkeypatch.delitem(registry.FAMILIES, "vipllava")
    model = tiny_vipllava()
    ids = torch.cat([text(4, 1), run(IMAGE_ID, 16), text(4, 2)], dim=1)
    assert _fallbacks(model, ids, pixel_values=llava_pixels(1)[None]) == {"media_inputs:vipllava": 2}


def test_onevision_prompt_mixing_tiled_and_single_patch_images_runs_cold() -> None:
    """LLaVA-OneVision with `batch_num_images=[1, 2]` in one prompt (one tiled image, two single-patch) runs cold."""
    model = cached_vlm("llava_onevision")
    kwargs = dict(llava_next_processor()([pil_image(1, 50, 40), pil_image(2), pil_image(3)], return_tensors="pt"))
    kwargs["batch_num_images"] = torch.tensor([1, 2])
    with torch.no_grad():
        features = model.model.get_image_features(**kwargs).pooler_output
    ids = torch.cat([text(4, 1), *[torch.cat([run(IMAGE_ID, f.shape[0]), text(2, 2)], 1) for f in features]], dim=1)
    assert _fallbacks(model, ids, **kwargs) == {"media_mixed_patching": 2}


@pytest.mark.parametrize(
    ("name", "setting", "value"),
    [
        ("llava", "vision_feature_layer", -2),
        ("llava_next", "vision_feature_layer", -2),
        ("llava_onevision", "vision_feature_layer", -2),
        ("llava_onevision", "vision_aspect_ratio", "anyres_max_1"),
    ],
)
def test_overriding_how_media_are_encoded_runs_cold(name: str, setting: str, value: Any) -> None:
    """A `generate` kwarg overriding the config's vision settings runs cold; the config's own value is served."""
    model = cached_vlm(name)
    if name == "llava":
        kwargs: dict[str, Any] = {"pixel_values": llava_pixels(1)[None]}
        n = 16
    else:
        kwargs = dict(llava_next_processor()([pil_image(1)], return_tensors="pt"))  # 32x32: one grid patch, no shrink
        (n,) = llava_next_tokens(model, kwargs["pixel_values"], kwargs["image_sizes"])
    ids = torch.cat([text(4, 1), run(IMAGE_ID, n), text(4, 2)], dim=1)
    assert _fallbacks(model, ids, **kwargs, **{setting: value}) == {f"vision_settings:{setting}": 2}
    with served(model, clean=False) as store:
        for _ in range(2):
            assert_same_as_cold(model, ids, store, new=3, **kwargs, **{setting: getattr(model.config, setting)})
        assert store.stats().hit_tokens == ids.shape[1] - 1 and not store.stats().fallbacks


def tiny_qwen3_vl_moe() -> Any:
    """Qwen3-VL-MoE: M-RoPE (`get_rope_index`); positions for a restored prefix come from its media adapter."""
    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3], "mrope_interleaved": True}
    config = transformers.Qwen3VLMoeConfig(
        text_config={
            **_TEXT,
            "model_type": "qwen3_vl_moe_text",
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "rope_parameters": rope,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "out_hidden_size": 64,
            "intermediate_size": 64,
            "num_heads": 4,
            "patch_size": 2,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
        },
        image_token_id=IMAGE_ID,
    )
    return _build(transformers.Qwen3VLMoeForConditionalGeneration, config)


def test_mrope_model_without_positions_runs_cold_even_for_text(monkeypatch: pytest.MonkeyPatch) -> None:
    """An M-RoPE family with no adapter computing positions (Qwen3-VL-MoE with its adapter taken away) keeps
    the blanket `mrope_positions` refusal: the rope_deltas left on the model may be stale."""
    monkeypatch.delitem(registry.FAMILIES, "qwen3_vl_moe")
    assert _fallbacks(tiny_qwen3_vl_moe(), text(12, 1)) == {"mrope_positions": 2}


def test_mrope_model_with_its_adapter_serves_text() -> None:
    """With its adapter (explicit positions), Qwen3-VL-MoE reuses text prompts."""
    model, ids = tiny_qwen3_vl_moe(), text(12, 1)
    with served(model, clean=False) as store:
        for _ in range(2):
            assert_same_as_cold(model, ids, store, new=3)
        assert store.stats().hit_tokens == ids.shape[1] - 1 and not store.stats().fallbacks


def test_media_kwarg_the_family_does_not_know_runs_cold() -> None:
    """A LLaVA call with pre-encoded features (`mm_encoder_outputs`) runs cold, named after the kwarg."""
    model = cached_vlm("llava")
    ids = torch.cat([text(4, 1), run(IMAGE_ID, 16), text(4, 2)], dim=1)
    with torch.no_grad():
        features = model.model.get_image_features(llava_pixels(1)[None])
    assert _fallbacks(model, ids, mm_encoder_outputs={"image": features}) == {"media_inputs:mm_encoder_outputs": 2}


def test_batched_media_requests_run_cold() -> None:
    """Two rows with images run cold (`media_batch`)."""
    model = cached_vlm("llava")
    ids = torch.cat([text(4, 1), run(IMAGE_ID, 16), text(4, 2)], dim=1).repeat(2, 1)
    kwargs = {"pixel_values": torch.stack([llava_pixels(1), llava_pixels(2)])}
    assert _fallbacks(model, ids, **kwargs) == {"media_batch": 2}


def test_placeholders_that_do_not_match_the_media_run_cold() -> None:
    """Two images' placeholders with one image run cold, and transformers' own error reaches the caller."""
    model = cached_vlm("llava")
    with served(model, clean=False) as store:
        ids = torch.cat([text(4, 1), run(IMAGE_ID, 16), text(4, 2), run(IMAGE_ID, 16)], dim=1)
        with pytest.raises(ValueError, match="do not match"):
            generate(model, ids, 3, past_key_values=store, pixel_values=llava_pixels(1)[None])
        assert store.stats().fallbacks == {"media_placeholders": 1}


def test_unhashable_media_run_cold() -> None:
    """Media of a type with no content hash (a list) run cold as `unhashable_media`."""
    model = cached_vlm("llava")
    with served(model, clean=False) as store:
        ids = torch.cat([text(4, 1), run(IMAGE_ID, 16), text(4, 2)], dim=1)
        # Whatever transformers then does with a list, the store must not serve it.
        with contextlib.suppress(Exception):
            generate(model, ids, 3, past_key_values=store, pixel_values=[llava_pixels(1)])
        assert store.stats().fallbacks == {"unhashable_media": 1}
        assert store.stats().entries == 0


@pytest.mark.parametrize(
    ("name", "ids", "problem"),
    [
        ("llava", torch.cat([text(4, 1), run(IMAGE_ID, 16)], dim=1), "media_placeholders"),
        ("qwen2_vl", text(8, 1), "mrope_positions"),
        ("paligemma", text(8, 1), "prefix_lm"),
    ],
)
def test_low_level_api_refuses_what_only_generate_keys_exactly(name: str, ids: torch.Tensor, problem: str) -> None:
    """`lookup`/`insert` key token ids only, so media placeholders, M-RoPE and prefix-LM prompts raise."""
    store = PrefixCache(cached_vlm(name), attach=False)
    with pytest.raises(ValueError, match=problem):
        store.lookup(ids)
    with pytest.raises(ValueError, match=problem):
        store.insert(ids, store._store.new_cache())


def test_low_level_api_serves_text_on_llava() -> None:
    """Text without placeholders still goes through `lookup`/`insert` on a vision-language model."""
    model = cached_vlm("llava")
    store = PrefixCache(model, attach=False)
    ids = text(10, 1)
    with store.lookup(ids) as hit, torch.no_grad():
        model(ids, past_key_values=hit.cache, use_cache=True)
    assert store.insert(ids, hit.cache) == 10
    with store.lookup(ids) as again:
        assert again.cached_len == 9


def test_text_batches_on_a_vision_language_model_store_each_row() -> None:
    """A text-only batch on LLaVA stores every row under its own ids, so each row later reuses its own prompt."""
    model = cached_vlm("llava")
    with served(model, clean=False) as store:
        common = text(8, 1)
        rows = torch.cat([torch.cat([common, text(6, 2)], dim=1), torch.cat([common, text(6, 3)], dim=1)])
        rows[1, 8] = 99 if rows[0, 8] != 99 else 98  # the rows diverge right after the common part
        out = assert_same_as_cold(model, rows, store, new=3)
        for i in range(2):
            follow = torch.cat([out.sequences[i : i + 1], text(3, 4)], dim=1)
            before = store.stats().hit_tokens
            assert_same_as_cold(model, follow, store, new=3)
            assert store.stats().hit_tokens - before == out.sequences.shape[1] - 1


@pytest.mark.parametrize("family", ["qwen2_vl", "gemma3"])
@pytest.mark.parametrize("marks", ["missing", "other"])
def test_media_without_the_processor_marks_run_cold(family: str, marks: str) -> None:
    """Without the processor's per-token marks (`mm_token_type_ids` for Qwen2-VL: M-RoPE positions;
    `token_type_ids` for Gemma 3: image blocks attending both ways), or with other marks,
    transformers computes other states, so a stored prompt with the same tokens and image must
    not be reused."""
    from hf_prefix_cache.testing.tiny_vlm_media import qwen_pixels
    from hf_prefix_cache.testing.tiny_vlm_parts import BOI_ID, EOI_ID, VISION_END_ID, VISION_START_ID

    model = cached_vlm(family)
    if family == "qwen2_vl":
        start, end, size = VISION_START_ID, VISION_END_ID, 6
        rows, grid = qwen_pixels(1)
        media: dict[str, Any] = {"pixel_values": rows, "image_grid_thw": grid}
        name = "mm_token_type_ids"
    else:
        start, end, size = BOI_ID, EOI_ID, 4
        media, name = {"pixel_values": llava_pixels(1)[None]}, "token_type_ids"
    ids = torch.cat([text(4, 1), run(start, 1), run(IMAGE_ID, size), run(end, 1), text(4, 2)], dim=1)
    proper = (ids == IMAGE_ID).int()
    with served(model, clean=False) as store:
        # Stored with the processor's marks first: the same tokens and image.
        assert_same_as_cold(model, ids, store, new=3, **media, **{name: proper})
        before = store.stats().hit_tokens
        other = {} if marks == "missing" else {name: torch.zeros_like(proper)}
        assert_same_as_cold(model, ids, store, new=3, **media, **other)
        assert store.stats().hit_tokens == before
        assert store.stats().fallbacks == {(f"{name}_missing" if marks == "missing" else name): 1}
