"""Gemma 3n images and audio clips served by the generic media adapter equal cold runs.

Gemma 3n's vision tower is a timm model (MobileNetV5), and timm needs torchvision: this module
skips in the suite (no timm on its path), and `tests/media/test_gemma3n_env.py` runs it with the
`.timm-packages` that `scripts/install` fills and the `support.torchvision_ops` plugin. The tiny
model and its media are `hf_prefix_cache/testing/media/gemma3n.py`'s (the support matrix's too).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import transformers
from conftest import Hits, assert_same_as_cold, generate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.multimodal.generic import GenericMedia
from hf_prefix_cache.testing.media.gemma3n import (
    AUD,
    BOA,
    EOA,
    IMG,
    MELS,
    SPECIAL_IDS,
    Medium,
    media_kwargs,
    medium,
    placeholders,
    tiny_gemma3n,
)
from hf_prefix_cache.testing.media.harness import conversation_store, converse_checked, expected_reuse
from hf_prefix_cache.testing.tiny_vlm_media import text
from media.conftest import store_fixture
from media.test_media_generic import Prompt

pytest.importorskip(
    "timm", reason="Gemma 3n's vision tower needs timm; tests/media/test_gemma3n_env.py runs this with .timm-packages"
)

NEW = 5
#: The random conversations' pool: two images, then two clips (each pair the same shape, other content).
POOL_SEEDS = (0, 1, 2, 5)


def check(ids: torch.Tensor, media: list[Medium], store: PrefixCache, **kwargs: Any) -> Any:
    """Run `ids` cold and through `store` (`assert_same_as_cold`); return the cached run."""
    model = tiny_gemma3n()
    kwargs = {**(kwargs or media_kwargs(ids, media)), "suppress_tokens": SPECIAL_IDS}
    return assert_same_as_cold(model, ids, store, NEW, cache_argument="past_key_values", **kwargs)


def encoded(ids: torch.Tensor, media: list[Medium], store: PrefixCache | None = None) -> dict[str, int]:
    """Run `ids` (through `store` if given); return how many images and clips each tower saw."""
    model = tiny_gemma3n()
    seen = {"image": 0, "audio": 0}

    def counter(kind: str) -> Any:
        def record(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], _out: Any) -> None:
            first = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
            seen[kind] += int(first.shape[0])

        return record

    towers = {"image": model.model.vision_tower, "audio": model.model.audio_tower}
    handles = [tower.register_forward_hook(counter(kind), with_kwargs=True) for kind, tower in towers.items()]
    extra = {"past_key_values": store} if store is not None else {}
    try:
        generate(model, ids, NEW, suppress_tokens=SPECIAL_IDS, **extra, **media_kwargs(ids, media))
    finally:
        for handle in handles:
            handle.remove()
    return seen


store = store_fixture(tiny_gemma3n)


def test_gemma3n_gets_the_generic_adapter() -> None:
    """Gemma 3n is a generic family with an image and an audio kind; its placeholders refuse token-only lookups."""
    adapter = media_adapter_for(tiny_gemma3n())
    assert isinstance(adapter, GenericMedia)
    assert adapter.placeholder_ids() == (IMG, AUD)
    assert adapter.manual_problem([4, AUD, 5]) == "media_placeholders"


def test_each_image_and_clip_is_encoded_on_its_own() -> None:
    """A tower's output for an image or a clip is the same alone as beside others (up to float rounding)."""
    inner = tiny_gemma3n().model
    with torch.no_grad():
        pixels = torch.stack([medium(s).data for s in (0, 1, 3)])
        together = inner.get_image_features(pixels).pooler_output
        for i in range(3):
            alone = inner.get_image_features(pixels[i : i + 1]).pooler_output
            assert (alone[0] - together[i]).abs().max() < 1e-5
        clips = [medium(s) for s in (2, 5, 8)]
        features, masks = torch.stack([c.data for c in clips]), torch.stack([c.mask for c in clips])
        assert len({int(m.sum()) for m in masks}) == 3  # three valid lengths, one padded length
        together = inner.get_audio_features(features, ~masks)
        for i in range(3):
            alone = inner.get_audio_features(features[i : i + 1], ~masks[i : i + 1])
            assert torch.equal(alone.audio_mel_mask[0], together.audio_mel_mask[i])
            assert (alone.pooler_output[0] - together.pooler_output[i]).abs().max() < 1e-5


def test_token_type_ids_are_never_read() -> None:
    """The model's logits do not change with `token_type_ids`: the adapter may pass them through unkeyed."""
    model = tiny_gemma3n()
    m1, clip = medium(1), medium(2)
    ids = torch.cat([text(3, 1), placeholders(m1), text(2, 2), placeholders(clip), text(2, 3)], dim=1)
    kwargs = media_kwargs(ids, [m1, clip])
    with torch.no_grad():
        marked = model(ids, **kwargs).logits
        kwargs["token_type_ids"] = torch.randint(0, 4, ids.shape)
        other = model(ids, **kwargs).logits
        del kwargs["token_type_ids"]
        none = model(ids, **kwargs).logits
    assert torch.equal(marked, other) and torch.equal(marked, none)


@pytest.mark.parametrize("seeds", [(1, 3), (2, 5), (1, 2)], ids=["images", "clips", "image-then-clip"])
def test_second_medium_in_the_suffix(store: PrefixCache, seeds: tuple[int, int]) -> None:
    """A prompt adding a second medium after a cached first reuses the first and encodes only the second."""
    hits = Hits(store)
    m1, m2 = medium(seeds[0]), medium(seeds[1])
    prefix = torch.cat([text(5, 1), placeholders(m1), text(6, 2)], dim=1)
    check(prefix, [m1], store)
    assert hits.last() == 0
    second = torch.cat([prefix, text(4, 3), placeholders(m2), text(3, 4)], dim=1)
    check(second, [m1, m2], store)
    assert hits.last() == prefix.shape[1]
    store.clear()
    check(prefix, [m1], store)
    hits.last()
    seen = encoded(second, [m1, m2], store)
    assert hits.last() == prefix.shape[1]
    assert seen == {"image": 0, "audio": 0, m2.kind: 1}


@pytest.mark.parametrize("seeds", [(1, 13), (2, 5)], ids=["image", "clip"])
def test_changed_first_medium_with_identical_tokens(store: PrefixCache, seeds: tuple[int, int]) -> None:
    """Identical token ids with another first medium reuse nothing past that medium's first placeholder."""
    hits = Hits(store)
    m1, other = medium(seeds[0]), medium(seeds[1])
    assert placeholders(m1).equal(placeholders(other)) and m1.kind == other.kind
    head = text(5, 1)
    ids = torch.cat([head, placeholders(m1), text(6, 2), placeholders(medium(0)), text(3, 4)], dim=1)
    check(ids, [m1, medium(0)], store)
    check(ids, [other, medium(0)], store)
    assert hits.last() == head.shape[1] + 1  # the begin marker before the first placeholder is text
    check(ids, [m1, medium(0)], store)
    assert hits.last() == ids.shape[1] - 1


def test_exact_repeat_encodes_nothing(store: PrefixCache) -> None:
    """Repeating a prompt with two images and two clips reuses all but the last token and runs neither tower."""
    hits = Hits(store)
    media = [medium(1), medium(2), medium(3), medium(5)]
    parts = [text(3, 1)]
    for i, m in enumerate(media):
        parts += [placeholders(m), text(2, 10 + i)]
    ids = torch.cat(parts, dim=1)
    check(ids, media, store)
    check(ids, media, store)
    assert hits.last() == ids.shape[1] - 1
    assert encoded(ids, media, store) == {"image": 0, "audio": 0}


def test_text_turn_reuses_media_without_the_towers(store: PrefixCache) -> None:
    """A follow-up text turn (all media re-sent, as a chat does) reuses the whole first turn: no tower runs."""
    hits = Hits(store)
    media = [medium(1), medium(2)]
    turn1 = torch.cat([text(4, 1), placeholders(media[0]), text(3, 2), placeholders(media[1]), text(3, 3)], dim=1)
    first = check(turn1, media, store).sequences
    turn2 = torch.cat([first, text(5, 4)], dim=1)
    second = check(turn2, media, store).sequences
    assert hits.last() == first.shape[1] - 1  # the answer's last token was never fed
    turn3 = torch.cat([second, text(3, 5)], dim=1)
    assert encoded(turn3, media, store) == {"image": 0, "audio": 0}
    assert hits.last() == second.shape[1] - 1


def test_clip_padded_to_a_longer_partner_keys_anew(store: PrefixCache) -> None:
    """The real feature extractor pads a prompt's clips to the longest: a re-padded clip is a new key, a clip
    beside a shorter one keeps its row and its reuse."""
    extractor = transformers.Gemma3nAudioFeatureExtractor(feature_size=MELS)
    rng = np.random.default_rng(0)
    first, longer, shorter = (rng.standard_normal(n).astype(np.float32) for n in (4000, 8000, 2000))
    clip = [BOA, *[AUD] * 4, EOA]
    head = text(4, 1)
    one = torch.cat([head, torch.tensor([clip]), text(3, 2)], dim=1)
    two = torch.cat([one, text(2, 3), torch.tensor([clip]), text(2, 4)], dim=1)

    def features(*clips: np.ndarray) -> dict[str, Any]:
        out = extractor(list(clips), return_tensors="pt")
        return {"input_features": out["input_features"], "input_features_mask": out["input_features_mask"]}

    hits = Hits(store)
    check(one, [], store, **features(first))
    padded = features(first, longer)
    assert padded["input_features"].shape[1] > features(first)["input_features"].shape[1]
    check(two, [], store, **padded)
    assert hits.last() == head.shape[1] + 1  # the first clip's row changed: reuse stops at its placeholders
    store.clear()
    check(one, [], store, **features(first))
    check(two, [], store, **features(first, shorter))
    assert hits.last() == one.shape[1]


# ------------------------------------------------------------------ random conversations

# A prompt piece: a few text tokens, or the index of a medium in the pool (images 0 and 1, clips 2 and 3).
pieces = st.one_of(st.lists(st.integers(4, 7), min_size=1, max_size=4), st.integers(0, len(POOL_SEEDS) - 1))
# A request: its new pieces, and whether it continues the previous answer (a chat turn).
requests = st.lists(st.tuples(st.lists(pieces, min_size=1, max_size=3), st.booleans()), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversation=requests)
def test_random_conversations_reuse_exactly_what_the_rules_allow(conversation: list[Any]) -> None:
    """Random chats of text, images and clips equal their cold runs and reuse exactly the longest keyed prefix."""
    pool = [medium(seed) for seed in POOL_SEEDS]
    with conversation_store(tiny_gemma3n()) as store:
        converse_checked(
            store,
            conversation,
            lambda: Prompt(pool),
            lambda ids, prompt: check(ids, [pool[i] for i in prompt.media], store),
            expected_reuse,
        )
