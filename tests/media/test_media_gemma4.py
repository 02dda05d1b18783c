"""Gemma 4 and Gemma 4 Unified serve images, videos and audio clips exactly, keyed by content.

Every request runs cold and through the store: equal tokens, logits within 1e-4, all media
passed every time as the processor would. Vision blocks attend both ways on sliding layers,
so cuts fall only before a whole placeholder run.
"""

from __future__ import annotations

from typing import Any

import torch
from conftest import Hits, assert_same_as_cold, generate

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.multimodal.gemma4 import Gemma4Media, Gemma4UnifiedMedia
from hf_prefix_cache.testing.media.gemma4 import FAMILIES, IMG, Gemma4Family, Medium
from hf_prefix_cache.testing.tiny_vlm_media import text
from media.conftest import family_fixture

NEW = 4
SPECIAL_IDS = list(range(100, 128))


def check(fam: Gemma4Family, ids: torch.Tensor, media: list[Medium], store: PrefixCache, **extra: Any) -> Any:
    """Run `ids` cold and through `store` (`assert_same_as_cold`); return the cached run."""
    kwargs = {**fam.kwargs(ids, media), "suppress_tokens": SPECIAL_IDS, **extra}
    return assert_same_as_cold(fam.model, ids, store, NEW, cache_argument="past_key_values", **kwargs)


def cat(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts, dim=1)


family = family_fixture(Gemma4Family, FAMILIES, no_fallbacks=False)


def test_each_family_gets_its_adapter() -> None:
    """Gemma 4 pools patches per placeholder; Gemma 4 Unified has one placeholder per patch."""
    assert type(media_adapter_for(Gemma4Family("gemma4").model)) is Gemma4Media
    assert type(media_adapter_for(Gemma4Family("gemma4_unified").model)) is Gemma4UnifiedMedia


def test_audio_and_video_after_a_cached_image(family: tuple[Gemma4Family, PrefixCache]) -> None:
    """A turn adding an audio clip and a video reuses the cached image turn whole, then the repeat reuses all."""
    fam, store = family
    hits = Hits(store)
    image, clip, video = fam.image(1), fam.clip(2), fam.video(5)
    first = cat(text(5, 1), fam.placeholders(image), text(6, 2))
    answer = check(fam, first, [image], store).sequences
    second = cat(answer, text(3, 3), fam.placeholders(clip), text(2, 4), fam.placeholders(video), text(3, 5))
    check(fam, second, [image, clip, video], store)
    assert hits.last() == answer.shape[1] - 1  # the answer's last token was never fed
    check(fam, second, [image, clip, video], store)
    assert hits.last() == second.shape[1] - 1
    assert not store.stats().fallbacks, store.stats().fallbacks


def test_changed_medium_reuses_nothing_past_its_first_placeholder(family: tuple[Gemma4Family, PrefixCache]) -> None:
    """Identical ids with another image, clip or video reuse only what precedes that medium's first placeholder."""
    fam, store = family
    hits = Hits(store)
    for build in (fam.image, fam.clip, fam.video):
        store.clear()
        one, other = build(1), build(13)  # seeds 1 and 13: same placeholders, other content
        assert one.tokens == other.tokens
        head = text(4, 7)
        ids = cat(head, fam.placeholders(one), text(5, 2))
        check(fam, ids, [one], store)
        check(fam, ids, [other], store)
        assert hits.last() == head.shape[1] + one.first, build.__name__
    assert not store.stats().fallbacks, store.stats().fallbacks


def test_only_suffix_media_reach_the_model(family: tuple[Gemma4Family, PrefixCache]) -> None:
    """After a cached image and clip, the model gets only the new image's rows."""
    fam, store = family
    image, clip, new = fam.image(1), fam.clip(2), fam.image(0)
    first = cat(text(3, 1), fam.placeholders(image), text(2, 2), fam.placeholders(clip), text(3, 3))
    check(fam, first, [image, clip], store)
    second = cat(first, text(2, 4), fam.placeholders(new), text(2, 5))
    inner = fam.model.model
    towers = {"image": inner.vision_tower, "audio": inner.audio_tower} if fam.pooled else {}
    towers = towers or {"image": inner.embed_vision, "audio": inner.embed_audio}
    seen: dict[str, list[torch.Tensor]] = {"image": [], "audio": []}

    def recorder(kind: str) -> Any:
        def record(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            seen[kind].append(args[0] if args else next(iter(kwargs.values())))

        return record

    handles = [tower.register_forward_pre_hook(recorder(kind), with_kwargs=True) for kind, tower in towers.items()]
    try:
        generate(fam.model, second, NEW, past_key_values=store, **fam.kwargs(second, [image, clip, new]))
    finally:
        for handle in handles:
            handle.remove()
    assert not seen["audio"]
    assert len(seen["image"]) == 1 and torch.equal(seen["image"][0], new.rows["pixel_values"])
    assert not store.stats().fallbacks


def test_images_sharing_one_run_run_cold(family: tuple[Gemma4Family, PrefixCache]) -> None:
    """Two images whose placeholders touch form one bidirectional block: no cut may fall between them, so cold."""
    fam, store = family
    one, two = fam.image(1), fam.image(0)
    bare = [t for t in (*one.tokens, *two.tokens) if t == IMG]
    ids = cat(text(3, 1), torch.tensor([bare]), text(3, 2))
    check(fam, ids, [one, two], store)
    check(fam, ids, [one, two], store)
    assert store.stats().hit_tokens == 0
    assert store.stats().fallbacks


def test_missing_marks_run_cold(family: tuple[Gemma4Family, PrefixCache]) -> None:
    """Without the processor's `mm_token_type_ids` vision blocks attend causally: those requests run cold."""
    fam, store = family
    image = fam.image(1)
    ids = cat(text(3, 1), fam.placeholders(image), text(3, 2))
    kwargs = {k: v for k, v in fam.kwargs(ids, [image]).items() if k != "mm_token_type_ids"}
    for _ in range(2):
        cold = generate(fam.model, ids, NEW, suppress_tokens=SPECIAL_IDS, **kwargs)
        warm = generate(fam.model, ids, NEW, past_key_values=store, suppress_tokens=SPECIAL_IDS, **kwargs)
        assert torch.equal(cold.sequences, warm.sequences)
    assert store.stats().hit_tokens == 0
    assert any("mm_token_type_ids" in reason for reason in store.stats().fallbacks)
