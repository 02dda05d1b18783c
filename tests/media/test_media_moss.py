"""MOSS Transcribe-Diarize's audio (`multimodal/moss.py`) is served exactly: each Whisper window an item.

Every request runs cold and through the store: equal tokens, logits within 1e-4, all clips
passed every time as the processor would, with its time-marker text among the placeholders.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import Hits, assert_same_as_cold

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.multimodal.moss import MossTranscribeDiarizeMedia
from hf_prefix_cache.testing.media.moss import (
    AUD,
    NEW,
    SPECIAL_IDS,
    Clip,
    media_kwargs,
    placeholders,
    tiny_moss,
)
from hf_prefix_cache.testing.tiny_vlm_media import text


def check(ids: torch.Tensor, clips: list[Clip], store: PrefixCache, **override: Any) -> Any:
    """Run `ids` cold and through `store`; assert equal tokens and logits within tolerance; return the cached run."""
    kwargs = {**media_kwargs(clips), "suppress_tokens": SPECIAL_IDS, **override}
    return assert_same_as_cold(tiny_moss(), ids, store, NEW, cache_argument="past_key_values", **kwargs)


@pytest.fixture
def store() -> Iterator[PrefixCache]:
    cache = PrefixCache(tiny_moss())
    yield cache
    cache.check_integrity()
    assert not cache.stats().fallbacks, cache.stats().fallbacks
    cache.detach()


def test_moss_gets_its_adapter() -> None:
    assert isinstance(media_adapter_for(tiny_moss()), MossTranscribeDiarizeMedia)


def test_second_clip_after_a_cached_turn(store: PrefixCache) -> None:
    """A turn adding a two-window clip reuses the first turn whole, and its repeat all but the last token."""
    hits = Hits(store)
    first_clip, second_clip = Clip(1), Clip(2)
    first = torch.cat([text(5, 1), placeholders(first_clip), text(6, 2)], dim=1)
    answer = check(first, [first_clip], store).sequences
    second = torch.cat([answer, text(4, 3), placeholders(second_clip), text(3, 4)], dim=1)
    check(second, [first_clip, second_clip], store)
    assert hits.last() == answer.shape[1] - 1
    check(second, [first_clip, second_clip], store)
    assert hits.last() == second.shape[1] - 1


def test_changed_clip_reuses_nothing_past_its_first_placeholder(store: PrefixCache) -> None:
    """Identical ids with another clip reuse the text and framing before its placeholders, no more."""
    hits = Hits(store)
    head = text(4, 7)
    ids = torch.cat([head, placeholders(Clip(1)), text(5, 2)], dim=1)
    check(ids, [Clip(1)], store)
    check(ids, [Clip(13)], store)
    assert hits.last() == head.shape[1] + 1
    check(ids, [Clip(1)], store)
    assert hits.last() == ids.shape[1] - 1


def test_a_changed_second_window_reuses_the_first(store: PrefixCache) -> None:
    """Each window is encoded on its own: changing a clip's second window keeps its first window's states."""
    hits = Hits(store)
    clip = Clip(2)
    ids = torch.cat([text(4, 7), placeholders(clip), text(5, 2)], dim=1)
    check(ids, [clip], store)
    kwargs = media_kwargs([clip])
    features = kwargs["input_features"].clone()
    features[1] = features[1].flip(-1) * kwargs["input_features_mask"][1]  # other content, same valid frames
    check(ids, [clip], store, input_features=features)
    second_window = int((ids[0] == AUD).nonzero()[clip.counts()[0]])
    assert hits.last() == second_window
