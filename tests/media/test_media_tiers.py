"""Media entries on the slower tiers: an entry keyed by media content survives a trip to disk and
a new store on the same folder, restores exactly, and a changed image still stops reuse at its start."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_prefix_cache.testing.media.harness import served
from hf_prefix_cache.testing.tiny_vlm_media import run, text
from media.test_media_exactness import Family


@pytest.mark.parametrize("name", ["llava", "qwen2_vl"])
def test_media_entry_restores_exactly_from_disk_in_a_new_store(name: str, tmp_path: Path) -> None:
    """A two-image prompt saved to disk is found by a fresh store, served exactly, and keyed by its pixels."""
    fam = Family(name)
    img1, img2, other = fam.image(1), fam.image(2), fam.image(13)
    prefix = torch.cat([text(5, 1), fam.placeholders(img1), text(6, 2)], dim=1)
    with served(fam.model, disk_dir=tmp_path, save_on_exit=False, clean=False) as store:
        fam.check(prefix, [img1], store)
        assert store.save() >= 1 and store.stats().disk_nbytes > 0
    with served(fam.model, disk_dir=tmp_path, save_on_exit=False, clean=False) as store:
        second = torch.cat([prefix, run(99, 1), text(4, 3), fam.placeholders(img2), text(3, 4)], dim=1)
        fam.check(second, [img1, img2], store)
        assert store.stats().hit_tokens == prefix.shape[1] and store.stats().reloads >= 1
        before = store.stats().hit_tokens
        fam.check(prefix, [other], store)  # same tokens, another picture: only the text before it is reused
        assert store.stats().hit_tokens - before == 5 + (1 if name == "qwen2_vl" else 0)
        assert not store.stats().fallbacks
        store.check_integrity()
