"""Gemma 3n images and audio clips served by the generic media adapter equal cold runs.

Gemma 3n's vision tower is a timm model (MobileNetV5), and timm needs torchvision: this module
skips in the suite (no timm on its path), and `tests/media/test_gemma3n_env.py` runs it with the
`.timm-packages` that `scripts/install` fills and the `support.torchvision_ops` plugin.

The tiny model mirrors the real layout: a text vocabulary of 128 ids, then 16 vision ids (the
first is the end-of-image id, the second the image placeholder) and 16 audio ids (end-of-audio,
then the audio placeholder), so placeholders and end markers take the towers' hard embeddings and
no per-layer token input, as in the real model. Four text layers, the last two sharing the first
two's keys/values, sliding window 8; the real MobileNetV5 encoder shrunk by `channel_multiplier`
(4 soft tokens per 32x32 image); a two-layer conformer (4 soft tokens per clip of up to 64 mel
frames). An image is ``<boi> IMG x4 <eoi>``, a clip ``<boa> AUD x4 <eoa>``; the processor's
`token_type_ids` are passed every time (the model never reads them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
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
from hf_prefix_cache.testing.media.harness import conversation_store, converse_checked, expected_reuse
from hf_prefix_cache.testing.tiny_build import _finalize
from hf_prefix_cache.testing.tiny_vlm_media import text
from media.conftest import store_fixture
from media.test_media_generic import Prompt

pytest.importorskip(
    "timm", reason="Gemma 3n's vision tower needs timm; tests/media/test_gemma3n_env.py runs this with .timm-packages"
)

BOI, EOI, IMG = 110, 128, 129  # end-of-image and image ids open the vision vocabulary (offset 128), as in Gemma 3n
BOA, EOA, AUD = 112, 144, 145  # end-of-audio and audio ids open the audio vocabulary (offset 144)
SPECIAL_IDS = list(range(100, 160))  # answers stay in text ids below 100
NEW = 5
FRAMES, MELS = 48, 16  # every clip of the pool: 48 mel frames (its valid part, then zero padding) of 16 bins
#: The random conversations' pool: two images, then two clips (each pair the same shape, other content).
POOL_SEEDS = (0, 1, 2, 5)


@functools.cache
def tiny_gemma3n() -> Any:
    """A tiny random-weight Gemma 3n (float32, eager, seed 0) with the real timm encoder, shrunk."""
    text_config = {
        "vocab_size": 160,
        "vocab_size_per_layer_input": 128,
        "hidden_size": 64,
        "hidden_size_per_layer_input": 8,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_kv_shared_layers": 2,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "sliding_window": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "altup_num_inputs": 2,
        "laurel_rank": 8,
        "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
        "max_position_embeddings": 512,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": None,
    }
    vision = {
        "architecture": "mobilenetv5_300m_enc",
        "model_args": {"channel_multiplier": 0.0625, "msfa_output_resolution": 2},
        "hidden_size": 2048,  # the encoder's fixed output width
        "vocab_size": 16,
        "vocab_offset": 128,
    }
    audio = {
        "vocab_size": 16,
        "vocab_offset": 144,
        "input_feat_size": MELS,
        "hidden_size": 32,
        "conf_num_attention_heads": 4,
        "conf_num_hidden_layers": 2,
        "sscp_conv_channel_size": [8, 4],
        "conf_conv_kernel_size": 3,
        "conf_attention_chunk_size": 4,
        "conf_attention_context_left": 5,
    }
    config = transformers.Gemma3nConfig(
        text_config=text_config,
        vision_config=vision,
        audio_config=audio,
        vision_soft_tokens_per_image=4,
        audio_soft_tokens_per_image=4,
        boi_token_id=BOI,
        eoi_token_id=EOI,
        image_token_id=IMG,
        boa_token_id=BOA,
        eoa_token_id=EOA,
        audio_token_id=AUD,
    )
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    return _finalize(transformers.Gemma3nForConditionalGeneration(config))


def _rand(seed: int, *shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@dataclass(frozen=True)
class Medium:
    """An image (`data` ``[3, 32, 32]``) or a clip (`data` ``[FRAMES, MELS]`` and its frame `mask`), with its tokens."""

    kind: str
    data: torch.Tensor
    mask: torch.Tensor | None
    tokens: tuple[int, ...]
    spans: tuple[tuple[int, int], ...] = ((1, 5),)


def medium(seed: int) -> Medium:
    """Pool medium `seed`: a clip for seeds 2, 5, 8, ... (each its own valid length), an image otherwise."""
    if seed % 3 != 2:
        return Medium("image", _rand(seed, 3, 32, 32), None, (BOI, *[IMG] * 4, EOI))
    valid = 20 + seed * 7 % 28
    mask = torch.arange(FRAMES) < valid
    return Medium("audio", _rand(seed, FRAMES, MELS) * mask[:, None], mask, (BOA, *[AUD] * 4, EOA))


def placeholders(m: Medium) -> torch.Tensor:
    return torch.tensor([list(m.tokens)])


def token_types(ids: torch.Tensor) -> torch.Tensor:
    """What the processor returns as `token_type_ids`: 1 on image placeholders, 3 on audio ones."""
    return (ids == IMG).long() + 3 * (ids == AUD).long()


def media_kwargs(ids: torch.Tensor, media: list[Medium]) -> dict[str, Any]:
    """What the processor hands `generate` for `media` in prompt order."""
    out: dict[str, Any] = {"token_type_ids": token_types(ids)}
    images = [m.data for m in media if m.kind == "image"]
    clips = [m for m in media if m.kind == "audio"]
    if images:
        out["pixel_values"] = torch.stack(images)
    if clips:
        out["input_features"] = torch.stack([c.data for c in clips])
        out["input_features_mask"] = torch.stack([c.mask for c in clips if c.mask is not None])
    return out


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
