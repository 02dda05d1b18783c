"""FastVLM's and Perception LM's media (generic-table rows over timm vision towers) are served exactly.

Their towers are timm models, and timm needs torchvision: this module skips in the suite (no timm
on its path), and `tests/media/test_gemma3n_env.py` runs it with the `.timm-packages` that
`scripts/install` fills and the `support.torchvision_ops` plugin. Every request runs cold and
through the store: equal tokens, logits within 1e-4, all media passed every time as the processor
would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import Hits

from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.multimodal.generic import GenericMedia
from hf_prefix_cache.testing.media import timm_towers as towers
from hf_prefix_cache.testing.media.harness import check, served
from hf_prefix_cache.testing.tiny_vlm_media import text

pytest.importorskip(
    "timm", reason="timm towers need timm; tests/media/test_gemma3n_env.py runs this with .timm-packages"
)

#: Per family: its model, a builder of its pool media by (kind, seed), their placeholders and kwargs.
FAMILIES: dict[str, tuple[Callable[[], Any], Callable[[str, int], Any], Any, Any]] = {
    "fast_vlm": (
        towers.tiny_fast_vlm,
        lambda _kind, seed: towers.fast_vlm_image(seed),
        towers.fast_vlm_placeholders,
        towers.fast_vlm_kwargs,
    ),
    "perception_lm": (
        towers.tiny_perception_lm,
        lambda kind, seed: towers.perception_lm_video(seed) if kind == "video" else towers.perception_lm_image(seed),
        towers.perception_lm_placeholders,
        towers.perception_lm_kwargs,
    ),
}
#: A first turn's medium and the one a second turn adds ((kind, seed) each).
TURNS = [
    ("fast_vlm", ("image", 1), ("image", 2)),
    ("perception_lm", ("image", 2), ("image", 5)),  # two tiles each (one tile count per call)
    ("perception_lm", ("image", 1), ("video", 2)),
    ("perception_lm", ("video", 1), ("image", 2)),
]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_is_a_generic_row(name: str) -> None:
    assert isinstance(media_adapter_for(FAMILIES[name][0]()), GenericMedia)


@pytest.mark.parametrize(("name", "first", "added"), TURNS, ids=[f"{n}-{f[0]}+{a[0]}" for n, f, a in TURNS])
def test_a_turn_adding_a_medium_reuses_the_previous_turn(name: str, first: tuple[str, int], added: Any) -> None:
    """The second turn reuses the first whole (but the answer's last token); its repeat, all but the last token."""
    build_model, medium, placeholders, kwargs = FAMILIES[name]
    model = build_model()
    one, two = medium(*first), medium(*added)
    with served(model) as store:
        hits = Hits(store)
        ids = torch.cat([text(5, 1), placeholders(one), text(6, 2)], dim=1)
        answer = check(model, ids, store, kwargs([one])).sequences
        second = torch.cat([answer, text(4, 3), placeholders(two), text(3, 4)], dim=1)
        check(model, second, store, kwargs([one, two]))
        assert hits.last() == answer.shape[1] - 1
        check(model, second, store, kwargs([one, two]))
        assert hits.last() == second.shape[1] - 1


@pytest.mark.parametrize(
    ("name", "kind"), [("fast_vlm", "image"), ("perception_lm", "image"), ("perception_lm", "video")]
)
def test_changed_medium_reuses_nothing_past_its_first_placeholder(name: str, kind: str) -> None:
    """Identical ids with another medium (seed 13: seed 1's shape) reuse the text before it; seed 1's again, all."""
    build_model, medium, placeholders, kwargs = FAMILIES[name]
    model = build_model()
    head = text(4, 7)
    ids = torch.cat([head, placeholders(medium(kind, 1)), text(5, 2)], dim=1)
    with served(model) as store:
        hits = Hits(store)
        check(model, ids, store, kwargs([medium(kind, 1)]))
        check(model, ids, store, kwargs([medium(kind, 13)]))
        assert hits.last() == head.shape[1]
        check(model, ids, store, kwargs([medium(kind, 1)]))
        assert hits.last() == ids.shape[1] - 1
