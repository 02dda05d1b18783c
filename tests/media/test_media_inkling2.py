"""Inkling 2 Loop's repeated passes over its looped layers keep their own cache layers, which the store serves.

Its forward appends, per pass after the first, copies of the looped layers' cache layers to a cache of
`num_hidden_layers` layers; the working cache holds them from the start (`model/loop_passes.py`), so a
text turn and a media turn reuse exactly, each pass's states restored. (Its images, and Inkling 2's, run
through the family suite, `test_media_families.py`.)
"""

from __future__ import annotations

import pytest
import torch
from conftest import Hits

from hf_prefix_cache.model.profile import profile_model
from hf_prefix_cache.testing.media import inkling2
from hf_prefix_cache.testing.media.harness import check, served
from hf_prefix_cache.testing.tiny_vlm_media import text

pytestmark = pytest.mark.skipif("inkling2_loop" not in inkling2.FAMILIES, reason="Inkling 2 Loop is new in 5.25")


def test_the_profile_holds_every_pass_of_the_looped_layers() -> None:
    """4 layers, layers 2-3 looped twice: 6 cache layers, the last two as the looped layers' kinds."""
    model = inkling2.tiny_inkling2("inkling2_loop")
    profile = profile_model(model)
    assert model.config.text_config.total_num_hidden_layers == len(profile.adapters) == 6
    assert [type(a) for a in profile.adapters[4:]] == [type(a) for a in profile.adapters[2:4]]


def test_a_looped_model_reuses_a_text_turn_exactly() -> None:
    """A second turn reuses the first whole (but the answer's last token), equal to its cold run."""
    model = inkling2.tiny_inkling2("inkling2_loop")
    with served(model) as store:
        hits = Hits(store)
        first = check(model, text(12, 1), store, {}).sequences
        second = torch.cat([first, text(6, 2)], dim=1)
        check(model, second, store, {})
        assert hits.last() == first.shape[1] - 1
        check(model, second, store, {})
        assert hits.last() == second.shape[1] - 1
