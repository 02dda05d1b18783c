"""Qwen3.5 (dense, MoE; hybrid recurrent text layers), Qwen3-VL-MoE, Cohere Compass and Cosmos 3 Omni serve media exactly.

Every request runs cold and through the store: equal tokens, logits within 1e-4. Qwen3.5's
gated delta-net layers hold recurrent states: the hook prefills media prompts itself, fed the
embeddings the forward computes, at the prompt's M-RoPE positions, and restores only where a
snapshot was taken (prompt end, answer end, divergence).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import Hits, assert_same_as_cold, generate

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.multimodal.qwen_vl import Qwen3_5Media, Qwen3VLMedia
from hf_prefix_cache.testing.media.qwen3 import FAMILIES, HYBRID, Medium, Qwen3Family
from hf_prefix_cache.testing.tiny_qwen_media import EncoderCalls
from hf_prefix_cache.testing.tiny_vlm_media import text

NEW = 4
SPECIAL_IDS = list(range(100, 128))


def check(fam: Qwen3Family, ids: torch.Tensor, media: list[Medium], store: PrefixCache) -> Any:
    """Run `ids` cold and through `store` (`assert_same_as_cold`); return the cached run."""
    kwargs = {**fam.kwargs(ids, media), "suppress_tokens": SPECIAL_IDS}
    return assert_same_as_cold(fam.model, ids, store, NEW, cache_argument="past_key_values", **kwargs)


@pytest.fixture(params=FAMILIES)
def family(request: pytest.FixtureRequest) -> Iterator[tuple[Qwen3Family, PrefixCache]]:
    fam = Qwen3Family(request.param)
    store = PrefixCache(fam.model)
    yield fam, store
    store.check_integrity()
    assert not store.stats().fallbacks, store.stats().fallbacks
    store.detach()


def test_each_family_gets_its_adapter() -> None:
    """Qwen3.5 computes suffix embeddings for its recurrent prefill; the deepstack families take Qwen3-VL's."""
    for name in HYBRID:
        adapter = media_adapter_for(Qwen3Family(name).model)
        assert type(adapter) is Qwen3_5Media and adapter.embeds_suffix
    for name in ("qwen3_vl_moe", "cohere_compass", "cosmos3_omni"):
        assert type(media_adapter_for(Qwen3Family(name).model)) is Qwen3VLMedia, name


def test_image_and_video_after_a_cached_image(family: tuple[Qwen3Family, PrefixCache]) -> None:
    """A turn adding an image and a video reuses the first turn whole, and its repeat all but the last token."""
    fam, store = family
    hits = Hits(store)
    first_image, image, video = fam.image(1), fam.image(2), fam.video(5)
    first = torch.cat([text(5, 1), fam.placeholders(first_image), text(6, 2)], dim=1)
    answer = check(fam, first, [first_image], store).sequences
    second = torch.cat(
        [answer, text(4, 3), fam.placeholders(image), text(3, 4), fam.placeholders(video), text(3, 5)], dim=1
    )
    check(fam, second, [first_image, image, video], store)
    assert hits.last() == answer.shape[1] - 1  # the answer's last token was never fed
    check(fam, second, [first_image, image, video], store)
    assert hits.last() == second.shape[1] - 1
    longer = torch.cat([second, text(20, 6)], dim=1)
    check(fam, longer, [first_image, image, video], store)
    # Attention reuses the whole second prompt; a hybrid, up to its last snapshot (the prompt's last fed token).
    assert hits.last() == second.shape[1] - (1 if fam.name in HYBRID else 0)


def test_changed_medium_reuses_nothing_past_its_first_placeholder(family: tuple[Qwen3Family, PrefixCache]) -> None:
    """Identical ids with another image or video reuse at most what precedes its first placeholder, and then all of it.

    A hybrid restores only at a snapshot: the divergence from the first request's prefix is one
    once a second request has stopped there.
    """
    fam, store = family
    hits = Hits(store)
    for build in (fam.image, fam.video):
        store.clear()
        one, other, third = build(1), build(13), build(25)  # seeds 1, 13, 25: same placeholders, other content
        head = text(4, 7)
        ids = torch.cat([head, fam.placeholders(one), text(5, 2)], dim=1)
        start = head.shape[1] + fam.first(one)
        check(fam, ids, [one], store)
        check(fam, ids, [other], store)
        assert hits.last() == (0 if fam.name in HYBRID else start)
        check(fam, ids, [third], store)
        assert hits.last() == start, build.__name__
        check(fam, ids, [one], store)
        assert hits.last() == ids.shape[1] - 1


def test_only_suffix_media_reach_the_tower(family: tuple[Qwen3Family, PrefixCache]) -> None:
    """After a cached image, the vision tower encodes only the new image's patch rows."""
    fam, store = family
    old, new = fam.image(1), fam.image(2)
    first = torch.cat([text(3, 1), fam.placeholders(old), text(3, 2)], dim=1)
    check(fam, first, [old], store)
    second = torch.cat([first, text(2, 4), fam.placeholders(new), text(2, 5)], dim=1)
    with EncoderCalls(fam.model, {"vision": "visual"}) as calls:
        generate(fam.model, second, NEW, past_key_values=store, **fam.kwargs(second, [old, new]))
    t, h, w = new.grid
    assert calls.total("vision") == t * h * w
