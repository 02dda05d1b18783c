"""Non-finite inputs never poison the store: states holding NaN or infinity are not stored."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import assert_same_as_cold, build, generate

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.media.families import SPECIAL_IDS, Family
from hf_prefix_cache.testing.tiny_vlm_media import run, text, video_frames
from hf_prefix_cache.testing.tiny_vlm_parts import VIDEO_ID

POISONS = {"nan": float("nan"), "inf": float("inf")}


def _poisoned_media(name: str, value: float) -> tuple[torch.Tensor, dict[str, Any]]:
    """A prompt `text, medium, text` whose medium holds one `value`, and its generate kwargs."""
    if name == "llava_next_video":
        ids = torch.cat([text(8, 1), run(VIDEO_ID, 8), text(3, 2)], dim=1)
        frames = video_frames(5)
        frames[0, 0, 0, 0] = value
        return ids, {"pixel_values_videos": frames[None]}
    fam = Family(name)
    item = fam.image(5)
    if name == "qwen2_audio":
        features, mask = item
        features = features.clone()
        features[0, 0] = value
        item = (features, mask)
    else:
        item = item.clone()
        item.view(-1)[0] = value
    ids = torch.cat([text(8, 1), fam.placeholders(item), text(3, 2)], dim=1)
    return ids, fam.kwargs(ids, [item])


@pytest.mark.parametrize("poison", sorted(POISONS))
@pytest.mark.parametrize("name", ["llava", "qwen2_audio", "llava_next_video"])
def test_non_finite_media_is_not_stored_and_clean_requests_stay_exact(name: str, poison: str) -> None:
    """A medium holding NaN or inf runs as cold, stores nothing, and later clean requests sharing its text stay exact."""
    fam = Family(name)
    model = fam.model
    store = PrefixCache(model)
    try:
        ids, kwargs = _poisoned_media(name, POISONS[poison])
        cold = generate(model, ids, 4, suppress_tokens=SPECIAL_IDS, **kwargs)
        warm = generate(model, ids, 4, past_key_values=store, suppress_tokens=SPECIAL_IDS, **kwargs)
        assert torch.equal(cold.sequences, warm.sequences)
        poisoned = not all(bool(step.isfinite().all()) for step in cold.logits)
        if poisoned:
            assert store.stats().fallbacks == {"non_finite_states": 1}
            assert store.stats().entries == 0
        # The text before the medium, image-free, then with a clean medium of the same kind.
        assert_same_as_cold(model, torch.cat([text(8, 1), text(4, 9)], dim=1), store, new=4)
        clean_ids, clean_kwargs = _poisoned_media(name, 0.5)
        assert_same_as_cold(model, clean_ids, store, new=4, suppress_tokens=SPECIAL_IDS, **clean_kwargs)
        assert_same_as_cold(model, clean_ids, store, new=4, suppress_tokens=SPECIAL_IDS, **clean_kwargs)
        assert store.stats().hit_tokens > 0
        store.check_integrity()
    finally:
        store.detach()


def _nan_embedding_llama() -> tuple[Any, int]:
    """A tiny Llama with a LoRA adapter that turns one token's embedding into NaN, and that token."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        build("llama"), peft.LoraConfig(r=2, target_modules=["embed_tokens"], init_lora_weights=False)
    )
    bad_token = 77
    with torch.no_grad():
        model.base_model.model.model.embed_tokens.lora_embedding_A["default"][:, bad_token] = float("nan")
    return model, bad_token


def test_nan_reaching_the_text_through_an_adapter_is_not_stored() -> None:
    """A LoRA adapter that turns one token's embedding into NaN poisons only requests with that token."""
    model, bad_token = _nan_embedding_llama()
    store = PrefixCache(model)
    try:
        head = text(10, 3)
        head[head == bad_token] = 5
        poisoned = torch.cat([head, torch.tensor([[bad_token]]), text(4, 4)], dim=1)
        warm = generate(model, poisoned, 3, past_key_values=store)
        assert not bool(warm.logits[0].isfinite().all())
        assert store.stats().fallbacks == {"non_finite_states": 1}
        clean = torch.cat([head, text(5, 6)], dim=1)
        clean[clean == bad_token] = 5
        assert_same_as_cold(model, clean, store, new=4)
        assert_same_as_cold(model, clean, store, new=4)
        assert store.stats().hit_tokens == clean.shape[1] - 1
    finally:
        store.detach()


def test_nan_after_a_restored_prefix_is_not_stored_and_the_prefix_still_serves() -> None:
    """NaN in the positions a hit computes after its restored prefix stores nothing; the prefix stays exact."""
    model, bad_token = _nan_embedding_llama()
    store = PrefixCache(model)
    try:
        head = text(12, 8)
        head[head == bad_token] = 5
        generate(model, head, 2, past_key_values=store)
        nbytes = store.stats().device_nbytes
        poisoned = torch.cat([head, torch.tensor([[bad_token]]), text(4, 9)], dim=1)
        generate(model, poisoned, 2, past_key_values=store)
        assert store.stats().hit_tokens > 0  # the poisoned request was served from the clean prefix
        assert store.stats().fallbacks == {"non_finite_states": 1}
        assert store.stats().device_nbytes == nbytes
        clean = torch.cat([head, text(5, 10)], dim=1)
        clean[clean == bad_token] = 5
        assert_same_as_cold(model, clean, store, new=3)
        store.check_integrity()
    finally:
        store.detach()
