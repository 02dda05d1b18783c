"""Media keyed by content, not by the processor's padding, where the model's output ignores the padding.

Idefics2's processor pads every image of a prompt to the largest one (`pixel_attention_mask` marks
the valid pixels): a turn that adds a larger image re-pads the earlier one. Idefics2 masks the
padded patches out of its encoder and resampler, so the earlier image keys by its valid region and
still matches. Phi-4-multimodal's audio encoder does read a clip's padding (its output changes),
so a clip stays keyed with its padding and a re-padded clip is computed again, counted as
`media_padding` when the store holds it unpadded or padded otherwise (a chat's second turn).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from conftest import LOGIT_TOL, Hits, assert_same_as_cold

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.media.families import SPECIAL_IDS, Family
from hf_prefix_cache.testing.media.generic import GenericFamily
from hf_prefix_cache.testing.media.generic_ids import AUD
from hf_prefix_cache.testing.media.harness import served
from hf_prefix_cache.testing.media.phi4 import MEL, Medium, _rand, cached_phi4, clip, kwargs, placeholders
from hf_prefix_cache.testing.tiny_vlm_media import text

HEAD = 5  # text ids before the first image's placeholders, its leading fake-image id included


def _idefics2_turns(small_width: int) -> tuple[int, int, Family, PrefixCache]:
    """Turn 1: a 32 x `small_width` image alone; turn 2 adds a 32x64 one, so the first is padded to 64.

    Returns the hit tokens of turn 2 and how many turn 1 stored (its prompt and answer, all but the last token).
    """
    fam = Family("idefics2")
    store = PrefixCache(fam.model)
    hits = Hits(store)
    gen = torch.Generator().manual_seed(0)
    small, large = torch.rand(3, 32, small_width, generator=gen), torch.rand(3, 32, 64, generator=gen)
    image = fam.placeholders(None)
    turn = torch.cat([text(4, 1), image, text(3, 2)], dim=1)
    out = assert_same_as_cold(
        fam.model, turn, store, new=5, pixel_values=small[None, None], suppress_tokens=SPECIAL_IDS
    )
    turn = torch.cat([out.sequences, text(2, 3), image, text(3, 4)], dim=1)
    pixels = torch.zeros(1, 2, 3, 32, 64)
    pixels[0, 0, :, :, :small_width], pixels[0, 1] = small, large
    mask = torch.zeros(1, 2, 32, 64, dtype=torch.bool)
    mask[0, 0, :, :small_width], mask[0, 1] = True, True
    hits.last()
    kw = {"pixel_values": pixels, "pixel_attention_mask": mask, "suppress_tokens": SPECIAL_IDS}
    assert_same_as_cold(fam.model, turn, store, new=5, **kw)
    assert not store.stats().fallbacks
    return hits.last(), out.sequences.shape[1] - 1, fam, store


def test_an_idefics2_image_padded_by_a_larger_later_one_still_matches() -> None:
    hit, stored, _, store = _idefics2_turns(32)
    store.detach()
    assert hit == stored  # the whole first turn, its image included (the case reused only 5)


def test_an_idefics2_image_whose_padding_reaches_a_patch_keeps_its_padded_key() -> None:
    """28 valid columns end inside a patch of 8: padded, that patch counts as valid and reads zeros, which the
    unpadded image drops. The key stays the padded crop (a conservative rule): exact, reusing the text before it."""
    hit, _, _, store = _idefics2_turns(28)
    store.detach()
    assert hit == HEAD


def test_a_phi4_clip_reads_its_padding_so_a_repadded_clip_is_computed_again() -> None:
    model, first_clip, second_clip = cached_phi4(), clip(1), clip(2)  # 40 frames, then 64: the first padded to 64
    ids = torch.cat([text(5, 1), placeholders(first_clip), text(6, 2)], dim=1)
    alone = {"audio_input_features": first_clip.data[None, :40], "audio_embed_sizes": torch.tensor([first_clip.count])}
    padded = {name: value[:1] for name, value in kwargs([first_clip, second_clip]).items()}
    assert _logit_gap(model, ids, alone, padded) > LOGIT_TOL  # the same clip, only padded otherwise
    with served(model, clean=False) as store:
        hits = Hits(store)
        out = assert_same_as_cold(model, ids, store, 4, cache_argument="past_key_values", **alone)
        turn = torch.cat([out.sequences, text(3, 3), placeholders(second_clip), text(3, 4)], dim=1)
        hits.last()
        both = kwargs([first_clip, second_clip])
        assert_same_as_cold(
            model, turn, store, 4, cache_argument="past_key_values", suppress_tokens=SPECIAL_IDS, **both
        )
        assert hits.last() == HEAD  # the text before the clip
        assert store.stats().fallbacks == {"media_padding": 1}  # said why: the clip is stored unpadded
        assert_same_as_cold(
            model, turn, store, 4, cache_argument="past_key_values", suppress_tokens=SPECIAL_IDS, **both
        )
        assert hits.last() == turn.shape[1] - 1  # padded alike, it matches
        assert store.stats().fallbacks == {"media_padding": 1}


def test_a_phi4_clip_stored_padded_and_repadded_by_a_longer_clip_counts_the_reuse_lost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A chat's second turn: the first turn's clip was padded (to 64 frames), a longer clip (80) re-pads it.

    Reuse stops at the clip (4 of the first turn's tokens, its text before the clip) and says why:
    `media_padding`, with the tokens the store held past it logged; the same clip padded alike matches whole.
    """
    model, first_clip = cached_phi4(), clip(1)
    longer = Medium("audio", _rand(7, 80, MEL), torch.tensor(80), 10)
    ids = torch.cat([text(4, 1), placeholders(first_clip), text(3, 2)], dim=1)  # 12 tokens
    with served(model, clean=False) as store:
        hits = Hits(store)
        out = assert_same_as_cold(model, ids, store, 4, cache_argument="past_key_values", **kwargs([first_clip]))
        stored = out.sequences.shape[1] - 1  # the first turn's prompt and answer, all but the last token
        turn = torch.cat([out.sequences, text(3, 3), placeholders(longer), text(3, 4)], dim=1)
        hits.last()
        both = _padded([first_clip, longer], 80)
        with caplog.at_level(logging.DEBUG, logger="hf_prefix_cache"):
            assert_same_as_cold(model, turn, store, 4, cache_argument="past_key_values", **both)
        assert hits.last() == 4  # the text before the clip
        assert store.stats().fallbacks == {"media_padding": 1}  # said why
        assert f"stored with other padding: {stored - 4} more tokens were stored" in caplog.text
        assert_same_as_cold(model, turn, store, 4, cache_argument="past_key_values", **both)
        assert hits.last() == turn.shape[1] - 1  # padded alike, it matches
        assert store.stats().fallbacks == {"media_padding": 1}


def test_a_glmasr_clip_repadded_by_a_longer_clip_counts_the_reuse_lost() -> None:
    """A generic "conv" row keys a clip with its padding (its tower reads it), and its valid frames as its content:
    a chat's second turn whose longer clip (56 frames) re-pads the first (40) reuses the text up to the clip, counted.
    """
    fam, first_clip = GenericFamily("glmasr"), GenericFamily("glmasr").medium(1)
    ids = torch.cat([text(4, 1), fam.placeholders(first_clip), text(3, 2)], dim=1)
    longer = torch.rand(16, 56, generator=torch.Generator().manual_seed(7))
    with served(fam.model, clean=False) as store:
        hits = Hits(store)
        out = assert_same_as_cold(fam.model, ids, store, 4, **fam.kwargs([first_clip]), suppress_tokens=SPECIAL_IDS)
        turn = torch.cat([out.sequences, text(3, 3), torch.tensor([[110, *[AUD] * 7, 111]]), text(3, 4)], dim=1)
        features, mask = torch.zeros(2, 16, 56), torch.zeros(2, 56, dtype=torch.long)
        features[0, :, :40], features[1], mask[0, :40], mask[1] = first_clip.rows[0], longer, 1, 1
        both = {"input_features": features, "input_features_mask": mask, "suppress_tokens": SPECIAL_IDS}
        hits.last()
        assert_same_as_cold(fam.model, turn, store, 4, **both)
        assert hits.last() == 5  # the text before the clip and its begin-audio id
        assert store.stats().fallbacks == {"media_padding": 1}


def _padded(clips: list[Medium], frames: int) -> dict[str, Any]:
    """Phi-4 clips padded to `frames` with their mask, as its feature extractor pads a prompt's clips to its longest."""
    features = torch.zeros(len(clips), frames, MEL)
    for i, c in enumerate(clips):
        features[i, : int(c.size)] = c.data[: int(c.size)]
    return {
        "audio_input_features": features,
        "audio_embed_sizes": torch.tensor([c.count for c in clips]),
        "audio_attention_mask": torch.stack([torch.arange(frames) < c.size for c in clips]),
    }


def _logit_gap(model: Any, ids: torch.Tensor, one: dict[str, Any], other: dict[str, Any]) -> float:
    with torch.no_grad():
        return float((model(ids, **one).logits - model(ids, **other).logits).abs().max())
