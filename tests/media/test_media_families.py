"""Every family of the test-builder registry (`testing/media/registry.py`) serves its media exactly.

One suite over all rows: each request runs cold and through the store (equal tokens, logits within
1e-4, all media passed every time as the processor would), and hits are counted. A family whose
text layers hold recurrent states restores only at a snapshot, so its cases expect less reuse
where a request diverges before one was taken. What only one family does stays in its own file.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import Hits

from hf_prefix_cache.testing.media import grid, hy_v4_vl, inkling2, ovis2_5, packed, qwen3, registry, speech_lms
from hf_prefix_cache.testing.media.cases import MediaCase
from hf_prefix_cache.testing.media.harness import check, served
from hf_prefix_cache.testing.tiny_vlm_media import text

CASES = registry.suite_cases()
IMAGE_AND_VIDEO = (("image", 2), ("video", 5))
#: Families of images and audio clips (Apertus 1.5 is new in transformers 5.25).
IMAGE_AND_AUDIO = ("inkling_mm_model", "nemotron_h_omni", *(("apertus1p5",) if "apertus1p5" in CASES else ()))
#: A first turn's medium and the media a second turn adds ((kind, seed) each), per family.
TURNS = [
    *[(name, ("image", 1), IMAGE_AND_VIDEO) for name in (*grid.FAMILIES, *qwen3.FAMILIES, *ovis2_5.FAMILIES)],
    *[(name, ("image", 1), (("image", 2),)) for name in (*packed.FAMILIES, *inkling2.FAMILIES)],
    *[
        (name, (first, 1), ((then, 2),))
        for name in IMAGE_AND_AUDIO
        for first, then in (("image", "image"), ("image", "audio"), ("audio", "image"))
    ],
    ("emu3", ("image", 1), (("image", 4),)),  # one size, other pixels
    ("ovis2", ("image", 1), (("image", 2),)),  # a global image, then a tiled one
    ("ovis2", ("image", 2), (("image", 4),)),  # a tiled image, then a global one
    # MOSS: a two-window clip.
    *[(name, ("audio", 1), (("audio", 2),)) for name in ("moss_transcribe_diarize", "vibevoice_asr")],
    # GraniteDocling: a one-tile page, then a two-tile one; Granite 4 Vision and DeepSeek-OCR 2: another size.
    *[(name, ("image", 1), (("image", 2),)) for name in ("granite_docling", "granite4_vision", "deepseek_ocr2")],
    # Muse Spark: images, videos and raw audio clips.
    *[
        ("muse_spark", (first, 1), tuple((then, seed) for then, seed in added))
        for first, added in (("image", IMAGE_AND_VIDEO), ("image", (("audio", 2),)), ("audio", (("image", 2),)))
    ],
    ("ernie4_5_vl_moe", ("image", 1), IMAGE_AND_VIDEO),
    ("hunyuan_vl", ("image", 1), (("image", 2),)),
    ("cosmos3_edge", ("image", 1), IMAGE_AND_VIDEO),
    *([("hy_v4_vl", ("image", 1), IMAGE_AND_VIDEO)] if hy_v4_vl.AVAILABLE else []),
    # Speech LMs: a second clip (longer for Qwen3-ASR and Fun-ASR-Nano: it pads the first one's row).
    *[(name, ("audio", 1), (("audio", 2),)) for name in speech_lms.BUILDERS],
]
#: The kinds of medium a family's changed-medium case runs with.
CHANGES = [
    (name, kind) for name in (*grid.FAMILIES, *qwen3.FAMILIES, *ovis2_5.FAMILIES) for kind in ("image", "video")
] + [
    *[(name, "image") for name in (*packed.FAMILIES, *inkling2.FAMILIES)],
    *[(name, kind) for name in IMAGE_AND_AUDIO for kind in ("image", "audio")],
    *[(name, "image") for name in ("emu3", "ovis2")],
    *[(name, "audio") for name in ("moss_transcribe_diarize", "vibevoice_asr")],
    *[(name, "image") for name in ("granite_docling", "granite4_vision", "deepseek_ocr2")],
    *[("muse_spark", kind) for kind in ("image", "video", "audio")],
    *[("ernie4_5_vl_moe", kind) for kind in ("image", "video")],
    ("hunyuan_vl", "image"),
    *[("cosmos3_edge", kind) for kind in ("image", "video")],
    *[("hy_v4_vl", kind) for kind in ("image", "video") if hy_v4_vl.AVAILABLE],
    *[(name, "audio") for name in speech_lms.BUILDERS],
]
assert {row[0] for row in TURNS} == {row[0] for row in CHANGES} == set(CASES), "every registry row runs its cases"


def _turn_id(name: str, first: tuple[str, int], added: Any) -> str:
    seed = "" if first[1] == 1 else str(first[1])
    return f"{name}-{first[0]}{seed}+{'+'.join(k for k, _ in added)}"


def _run(case: MediaCase, ids: torch.Tensor, media: list[Any], store: Any) -> Any:
    return check(case.model, ids, store, case.kwargs(ids, media))


@pytest.mark.parametrize(("name", "first", "added"), [pytest.param(*row, id=_turn_id(*row)) for row in TURNS])
def test_a_turn_adding_media_reuses_the_previous_turn(name: str, first: tuple[str, int], added: Any) -> None:
    """A turn adding media reuses the first turn whole (but the answer's last token), and its repeat all but the last token."""
    case = CASES[name]()
    with served(case.model) as store:
        hits = Hits(store)
        first_medium = case.media[first[0]](first[1])
        new = [case.media[kind](seed) for kind, seed in added]
        ids = torch.cat([text(5, 1), case.placeholders(first_medium), text(6, 2)], dim=1)
        answer = _run(case, ids, [first_medium], store).sequences
        pieces = [answer, text(4, 3)]
        for i, medium in enumerate(new):
            pieces += [case.placeholders(medium), text(3, 4 + i)]
        second = torch.cat(pieces, dim=1)
        _run(case, second, [first_medium, *new], store)
        assert hits.last() == answer.shape[1] - 1  # the answer's last token was never fed
        _run(case, second, [first_medium, *new], store)
        assert hits.last() == second.shape[1] - 1
        if case.longer:
            _run(case, torch.cat([second, text(20, 6)], dim=1), [first_medium, *new], store)
            # Attention reuses the whole second prompt; states, up to their last snapshot (the prompt's last fed token).
            assert hits.last() == second.shape[1] - (1 if case.states else 0)


@pytest.mark.parametrize(("name", "kind"), [pytest.param(*row, id=f"{row[0]}-{row[1]}") for row in CHANGES])
def test_changed_medium_reuses_nothing_past_its_first_placeholder(name: str, kind: str) -> None:
    """Identical ids with another medium reuse at most the text and framing before its placeholders.

    A family with states restores only at a snapshot: the divergence from the first request's
    prefix is one once a second request has stopped there.
    """
    case = CASES[name]()
    build = case.media[kind]
    with served(case.model) as store:
        hits = Hits(store)
        one = build(1)  # seeds 1, 13, 25: same placeholders, other content
        head = text(4, 7)
        ids = torch.cat([head, case.placeholders(one), text(5, 2)], dim=1)
        start = head.shape[1] + case.framing(one)  # the framing ids before the first placeholder are text
        _run(case, ids, [one], store)
        for i, seed in enumerate(case.changes):
            _run(case, ids, [build(seed)], store)
            assert hits.last() == (0 if case.states and i == 0 else start)
        if case.repeat:
            _run(case, ids, [one], store)
            assert hits.last() == ids.shape[1] - 1


def test_every_suite_row_is_keyed_as_the_media_registry_keys_its_family() -> None:
    """The test builders and the adapters share one key per family: each suite row names a served family."""
    from hf_prefix_cache.multimodal import registry as media_registry

    assert set(CASES) <= set(media_registry.served()), sorted(set(CASES) - set(media_registry.served()))
