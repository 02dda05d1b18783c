"""Inkling's images and audio clips (a generic-table row with suffix embeddings) are served exactly.

Its vision tower encodes each patch row on its own into one placeholder (so every patch is an
item), and an audio clip is a row of dMel bin ids with one placeholder per valid frame. Its
hybrid text layers hold conv states, so the hook prefills media prompts itself from suffix
embeddings. Every request runs cold and through the store: equal tokens, logits within 1e-4, all
media passed every time as the processor would.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import transformers
from conftest import LOGIT_TOL, Hits, generate, max_logit_diff
from tiny_vlms import _build, text

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.multimodal.generic import GenericMedia

IMG, AUD, IMAGE_BOS, AUDIO_BOS = 120, 126, 110, 111
NEW = 4
SPECIAL_IDS = list(range(100, 128))
#: Per pool seed (seeds 1 and 13 alike): an image's patches, a clip's valid frames (of 10, its padded length).
PATCHES, FRAMES, PADDED = [6, 6, 4], [7, 7, 5], 10
MEL_BINS, MEL_VOCAB = 8, 16
_TEXT = {
    "vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 16,
    "sliding_window_size": 8,
    "layer_types": ["hybrid_sliding", "hybrid"],
    "mlp_layer_types": ["sparse", "sparse"],
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "pad_token_id": 0,
    "eos_token_id": None,
}


@functools.cache
def tiny_inkling() -> Any:
    """Inkling: a patch-wise vision tower on 2 x 4x4-pixel patches, dMel audio (8 bins of 16 values); hybrid
    [sliding, full] text layers with conv states and experts."""
    config = transformers.InklingConfig(
        text_config=_TEXT,
        vision_config={"patch_size": 4, "hidden_size": 32, "n_layers": 2, "num_attention_heads": 4},
        audio_config={"n_mel_bins": MEL_BINS, "mel_vocab_size": MEL_VOCAB},
        image_token_id=IMG,
        audio_token_id=AUD,
        image_bos_token_id=IMAGE_BOS,
        audio_bos_token_id=AUDIO_BOS,
    )
    return _build(transformers.InklingForConditionalGeneration, config)


@dataclass(frozen=True)
class Medium:
    kind: str
    seed: int

    @property
    def size(self) -> int:
        """Its placeholders: patches of an image, valid frames of a clip."""
        return (PATCHES if self.kind == "image" else FRAMES)[self.seed % 3]


def image(seed: int) -> Medium:
    return Medium("image", seed)


def clip(seed: int) -> Medium:
    return Medium("audio", seed)


def placeholders(medium: Medium) -> torch.Tensor:
    bos, token = (IMAGE_BOS, IMG) if medium.kind == "image" else (AUDIO_BOS, AUD)
    return torch.tensor([[bos, *[token] * medium.size]])


def media_kwargs(media: list[Medium]) -> dict[str, Any]:
    """What the processor hands `generate`: all images' patch rows; clips padded to 10 frames with their mask."""
    out: dict[str, Any] = {}
    images = [m for m in media if m.kind == "image"]
    if images:
        out["pixel_values"] = torch.cat(
            [torch.rand(m.size, 2, 4, 4, 3, generator=torch.Generator().manual_seed(m.seed)) for m in images]
        )
    clips = [m for m in media if m.kind == "audio"]
    if clips:
        ids = torch.zeros(len(clips), PADDED, MEL_BINS, dtype=torch.int32)
        mask = torch.zeros(len(clips), PADDED, dtype=torch.int32)
        for i, m in enumerate(clips):
            gen = torch.Generator().manual_seed(m.seed)
            ids[i, : m.size] = torch.randint(0, MEL_VOCAB, (m.size, MEL_BINS), generator=gen, dtype=torch.int32)
            mask[i, : m.size] = 1
        out["audio_input_ids"], out["audio_input_ids_mask"] = ids, mask
    return out


def check(ids: torch.Tensor, media: list[Medium], store: PrefixCache) -> Any:
    """Run `ids` cold and through `store`; assert equal tokens and logits within tolerance; return the cached run."""
    model = tiny_inkling()
    kwargs = {**media_kwargs(media), "suppress_tokens": SPECIAL_IDS}
    cold = generate(model, ids, NEW, **kwargs)
    warm = generate(model, ids, NEW, past_key_values=store, **kwargs)
    assert torch.equal(cold.sequences, warm.sequences), f"tokens differ:\n{cold.sequences}\n{warm.sequences}"
    diff = max_logit_diff(cold, warm)
    assert diff < LOGIT_TOL, f"logits differ by {diff}"
    return warm


@pytest.fixture
def store() -> Iterator[PrefixCache]:
    cache = PrefixCache(tiny_inkling())
    yield cache
    cache.check_integrity()
    assert not cache.stats().fallbacks, cache.stats().fallbacks
    cache.detach()


def test_the_generic_adapter_serves_it() -> None:
    assert isinstance(media_adapter_for(tiny_inkling()), GenericMedia)


def test_the_tower_encodes_each_patch_on_its_own() -> None:
    model = tiny_inkling()
    rows = media_kwargs([image(1), image(2)])["pixel_values"]
    with torch.no_grad():
        together = model.model.get_image_features(rows).pooler_output
        alone = torch.cat([model.model.get_image_features(rows[i : i + 1]).pooler_output for i in range(len(rows))])
    torch.testing.assert_close(alone, together, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kinds", [("image", "image"), ("image", "audio"), ("audio", "image")])
def test_second_medium_after_a_cached_turn(kinds: tuple[str, str], store: PrefixCache) -> None:
    """A turn adding a medium reuses the first turn whole, and its repeat all but the last token."""
    hits = Hits(store)
    first_medium, second_medium = Medium(kinds[0], 1), Medium(kinds[1], 2)
    first = torch.cat([text(5, 1), placeholders(first_medium), text(6, 2)], dim=1)
    answer = check(first, [first_medium], store).sequences
    second = torch.cat([answer, text(4, 3), placeholders(second_medium), text(3, 4)], dim=1)
    check(second, [first_medium, second_medium], store)
    assert hits.last() == answer.shape[1] - 1
    check(second, [first_medium, second_medium], store)
    assert hits.last() == second.shape[1] - 1


@pytest.mark.parametrize("build", [image, clip])
def test_changed_medium_reuses_nothing_past_its_first_placeholder(build: Any, store: PrefixCache) -> None:
    """Identical ids with another image or clip reuse at most the text and framing before its placeholders
    (once a snapshot was taken there)."""
    hits = Hits(store)
    head = text(4, 7)
    ids = torch.cat([head, placeholders(build(1)), text(5, 2)], dim=1)
    check(ids, [build(1)], store)
    check(ids, [build(13)], store)
    assert hits.last() == 0
    check(ids, [build(25)], store)
    assert hits.last() == head.shape[1] + 1
