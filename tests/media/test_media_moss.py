"""MOSS Transcribe-Diarize's audio (`multimodal/moss.py`) is served exactly: each Whisper window an item.

Every request runs cold and through the store: equal tokens, logits within 1e-4, all clips
passed every time as the processor would, with its time-marker text among the placeholders. A
turn adding a two-window clip and a changed clip are the family suite's cases (its `moss` row).
"""

from __future__ import annotations

import torch
from conftest import Hits

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.multimodal.moss import MossTranscribeDiarizeMedia
from hf_prefix_cache.testing.media.harness import check
from hf_prefix_cache.testing.media.moss import AUD, Clip, media_kwargs, placeholders, tiny_moss
from hf_prefix_cache.testing.tiny_vlm_media import text
from media.conftest import store_fixture

store = store_fixture(tiny_moss)


def test_moss_gets_its_adapter() -> None:
    assert isinstance(media_adapter_for(tiny_moss()), MossTranscribeDiarizeMedia)


def test_a_changed_second_window_reuses_the_first(store: PrefixCache) -> None:
    """Each window is encoded on its own: changing a clip's second window keeps its first window's states."""
    hits = Hits(store)
    clip = Clip(2)
    ids = torch.cat([text(4, 7), placeholders(clip), text(5, 2)], dim=1)
    kwargs = media_kwargs([clip])
    check(tiny_moss(), ids, store, kwargs)
    features = kwargs["input_features"].clone()
    features[1] = features[1].flip(-1) * kwargs["input_features_mask"][1]  # other content, same valid frames
    check(tiny_moss(), ids, store, kwargs, input_features=features)
    second_window = int((ids[0] == AUD).nonzero()[clip.counts()[0]])
    assert hits.last() == second_window
