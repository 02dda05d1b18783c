"""Fuyu's images: every patch an item (its own linear embedding); the older `image_patches` name is served too.

The held-out cases (second image, changed image, random conversations) run in
`tests/test_media_generic.py` with the other generic families; this pins the alias.
"""

from __future__ import annotations

import torch
from conftest import LOGIT_TOL, Hits, generate, max_logit_diff

from hf_prefix_cache.testing.media.generic import NEW, GenericFamily
from hf_prefix_cache.testing.media.generic_ids import SPECIAL_IDS
from hf_prefix_cache.testing.media.harness import served
from hf_prefix_cache.testing.tiny_vlm_media import text


def test_image_patches_under_their_older_name_are_served() -> None:
    """Patches passed as `image_patches` key and reuse exactly as under `pixel_values`."""
    fam = GenericFamily("fuyu")
    with served(fam.model, clean=False) as store:
        hits = Hits(store)
        m1, m2 = fam.medium(1), fam.medium(2)
        first = torch.cat([text(4, 1), fam.placeholders(m1), text(3, 2)], dim=1)
        second = torch.cat([first, text(2, 3), fam.placeholders(m2), text(2, 4)], dim=1)
        for ids, media in ((first, [m1]), (second, [m1, m2])):
            patches = fam.kwargs(media)["pixel_values"]
            cold = generate(fam.model, ids, NEW, pixel_values=patches, suppress_tokens=SPECIAL_IDS)
            warm = generate(
                fam.model, ids, NEW, image_patches=patches, past_key_values=store, suppress_tokens=SPECIAL_IDS
            )
            assert torch.equal(cold.sequences, warm.sequences)
            assert max_logit_diff(cold, warm) < LOGIT_TOL
        assert hits.last() == first.shape[1]
        assert not store.stats().fallbacks
