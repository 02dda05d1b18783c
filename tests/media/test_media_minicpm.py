"""MiniCPM-o OCR (the generic table's ``"packed"`` row) serves images exactly; MiniCPM-V 4.6's 16x mode runs cold.

Their images reach the model as one NaViT-packed row with a patch grid per image, and their
Qwen3.5 text layers hold recurrent states, so the hook prefills media prompts itself from
suffix embeddings. Every request runs cold and through the store: equal tokens, logits within
1e-4, all images passed every time as the processor would.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.multimodal.generic import GenericMedia
from hf_prefix_cache.testing.media import harness
from hf_prefix_cache.testing.media.harness import same_tokens_twice, served
from hf_prefix_cache.testing.media.packed import FAMILIES, Image, PackedFamily, cached_packed
from hf_prefix_cache.testing.tiny_vlm_media import text
from media.conftest import family_fixture

family = family_fixture(PackedFamily, FAMILIES)


def check(fam: PackedFamily, ids: torch.Tensor, images: list[Image], store: PrefixCache) -> Any:
    return harness.check(fam.model, ids, store, fam.kwargs(images))


def test_the_generic_adapter_serves_them() -> None:
    for name in FAMILIES:
        assert isinstance(media_adapter_for(PackedFamily(name).model), GenericMedia), name


def test_the_tower_encodes_each_image_on_its_own(family: tuple[PackedFamily, PrefixCache]) -> None:
    """An image's features do not depend on the other images packed with it."""
    fam, _ = family
    images = [fam.image(1), fam.image(2), fam.image(0)]
    with torch.no_grad():
        together = fam.model.model.get_image_features(**fam.kwargs(images)).pooler_output
        for image, features in zip(images, together, strict=True):
            (alone,) = fam.model.model.get_image_features(**fam.kwargs([image])).pooler_output
            torch.testing.assert_close(alone, features, rtol=0, atol=1e-6)


def test_only_suffix_images_reach_the_tower(family: tuple[PackedFamily, PrefixCache]) -> None:
    """After two cached images, the tower encodes only the new image's patches."""
    fam, store = family
    a, b, new = fam.image(1), fam.image(2), fam.image(4)
    first = torch.cat([text(3, 1), fam.placeholders(a), text(2, 6), fam.placeholders(b), text(3, 2)], dim=1)
    check(fam, first, [a, b], store)
    second = torch.cat([first, text(2, 4), fam.placeholders(new), text(2, 5)], dim=1)
    seen: list[list[int]] = []

    def record(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.append(kwargs["target_sizes"].tolist())

    handle = fam.model.model.vision_tower.register_forward_pre_hook(record, with_kwargs=True)
    try:
        check(fam, second, [a, b, new], store)
    finally:
        handle.remove()
    # The cold run encodes all three; the cached run only the new one.
    assert seen == [[list(a.grid), list(b.grid), list(new.grid)], [list(new.grid)]]


def test_other_downsample_mode_runs_cold(family: tuple[PackedFamily, PrefixCache]) -> None:
    """A call overriding `downsample_mode` changes every image's features and counts: it runs cold, named."""
    fam, _ = family
    image = Image(1, (8, 8))
    ids = torch.cat([text(4, 1), torch.tensor([[110, *[120] * 4, 111]]), text(3, 2)], dim=1)  # 16x: 64 / 16
    with served(fam.model, clean=False) as store:
        same_tokens_twice(fam.model, ids, store, **fam.kwargs([image]), downsample_mode="16x")
        assert store.stats().hit_tokens == 0
        assert store.stats().fallbacks == {"vision_settings:downsample_mode": 2}


def test_16x_mode_keeps_no_adapter() -> None:
    """In "16x" mode an image's features depend on the images packed before it: such a model runs media cold."""
    model = cached_packed("minicpmv4_6", "16x")
    fam = PackedFamily("minicpm_ocr")  # its images and kwargs (the same layout)
    first, later = Image(1, (8, 8)), Image(2, (4, 8))
    with torch.no_grad():
        (alone,) = model.model.get_image_features(**fam.kwargs([later])).pooler_output
        _, packed = model.model.get_image_features(**fam.kwargs([first, later])).pooler_output
    assert (alone - packed).abs().max() > 1e-3  # not the per-image pattern
    assert media_adapter_for(model) is None
    ids = torch.cat([text(4, 1), torch.tensor([[110, *[120] * 4, 111]]), text(3, 2)], dim=1)
    with served(model, clean=False) as store:
        same_tokens_twice(model, ids, store, **fam.kwargs([first]))
        assert store.stats().fallbacks == {"media_inputs:minicpmv4_6": 2}
