"""VibeVoice ASR's audio clips (a generic-table row) are served exactly on its deterministic path.

Its audio encoder adds random noise to the acoustic latents unless a call passes
``sample=False``; such calls are served, and a call with clips that leaves `sample` at its
default runs cold (`media_random:sample`). Every request runs cold and through the store: equal
tokens, logits within 1e-4, all clips passed every time as the processor would.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import Hits, assert_same_as_cold

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.multimodal.generic import GenericMedia
from hf_prefix_cache.testing.media.vibevoice import (
    NEW,
    SPECIAL_IDS,
    Clip,
    media_kwargs,
    placeholders,
    tiny_vibevoice_asr,
)
from hf_prefix_cache.testing.tiny_vlm_media import text


def check(ids: torch.Tensor, clips: list[Clip], store: PrefixCache, **extra: Any) -> Any:
    """Run `ids` cold and through `store`; assert equal tokens and logits within tolerance; return the cached run."""
    kwargs = {**media_kwargs(clips), "suppress_tokens": SPECIAL_IDS, **extra}
    return assert_same_as_cold(tiny_vibevoice_asr(), ids, store, NEW, cache_argument="past_key_values", **kwargs)


@pytest.fixture
def store() -> Iterator[PrefixCache]:
    cache = PrefixCache(tiny_vibevoice_asr())
    yield cache
    cache.check_integrity()
    cache.detach()


def test_the_generic_adapter_serves_it() -> None:
    assert isinstance(media_adapter_for(tiny_vibevoice_asr()), GenericMedia)


def test_a_clip_encodes_alike_alone_and_padded_beside_a_longer_one() -> None:
    """The tokenizers encode each row on its own; a shorter clip's valid features ignore its padding."""
    model, short, long = tiny_vibevoice_asr(), Clip(2), Clip(1)
    with torch.no_grad():
        together = model.model.get_audio_features(**media_kwargs([long, short])).pooler_output
        alone = [model.model.get_audio_features(**media_kwargs([c])).pooler_output for c in (long, short)]
    torch.testing.assert_close(torch.cat(alone), together, rtol=0, atol=1e-5)


def test_second_clip_after_a_cached_turn(store: PrefixCache) -> None:
    """A turn adding a clip reuses the first turn whole, and its repeat all but the last token."""
    hits = Hits(store)
    first_clip, second_clip = Clip(1), Clip(2)
    first = torch.cat([text(5, 1), placeholders(first_clip), text(6, 2)], dim=1)
    answer = check(first, [first_clip], store).sequences
    second = torch.cat([answer, text(4, 3), placeholders(second_clip), text(3, 4)], dim=1)
    check(second, [first_clip, second_clip], store)
    assert hits.last() == answer.shape[1] - 1
    check(second, [first_clip, second_clip], store)
    assert hits.last() == second.shape[1] - 1
    assert not store.stats().fallbacks, store.stats().fallbacks


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
    assert not store.stats().fallbacks, store.stats().fallbacks


def test_the_default_noisy_encoding_runs_cold(store: PrefixCache) -> None:
    """Clips without ``sample=False`` run cold, counted; the same noise (one seed) gives the cold run's output."""
    model, clip = tiny_vibevoice_asr(), Clip(1)
    ids = torch.cat([text(5, 1), placeholders(clip), text(6, 2)], dim=1)
    check(ids, [clip], store)  # the deterministic path, stored
    hits = Hits(store)
    kwargs = {**media_kwargs([clip], sample=None), "suppress_tokens": SPECIAL_IDS}
    torch.manual_seed(5)
    cold = model.generate(ids, max_new_tokens=NEW, do_sample=False, **kwargs)
    torch.manual_seed(5)
    warm = model.generate(ids, max_new_tokens=NEW, do_sample=False, past_key_values=store, **kwargs)
    assert torch.equal(cold, warm)
    assert hits.last() == 0
    assert store.stats().fallbacks == {"media_random:sample": 1}
