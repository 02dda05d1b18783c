"""Rows with their own media, and text-only rows, of vision-language models decode together exactly.

Each row's tokens equal `model.generate` on its prompt and media alone (cold, and through a store run one
request after another), its per-step logits within LOGIT_TOL of the cold run's; its cached tokens equal
the sequential path's: a request with a stored image reuses it, one with another image stops before it,
and the next turn reuses the whole stored answer. Tiny random-weight models of every family the engine
joins: LLaVA, LLaVA-NeXT(-Video), Gemma 3, Idefics2/3, SmolVLM, Qwen2-Audio (positions count tokens), and
Qwen2-VL, Qwen2.5-VL, Qwen3-VL, the GLM-4V family and PaddleOCR-VL (M-RoPE: every row's positions shifted
off its cache length, the shifts unequal per axis where a prompt ends on its image or video)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import CACHE_NAME, LOGIT_TOL

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.api.prefix_cache import store_of
from hf_prefix_cache.batching.batch import RunningBatch
from hf_prefix_cache.batching.eligibility import JOINING_MEDIA_TYPES, model_alone_reason
from hf_prefix_cache.batching.rows import EndReason, Request, Row
from hf_prefix_cache.batching.sampling import Sampling
from hf_prefix_cache.batching.scheduler import Scheduler
from hf_prefix_cache.testing.media.families import FRAMED, SPECIAL_IDS, Family
from hf_prefix_cache.testing.tiny_qwen_media import cached_omni
from hf_prefix_cache.testing.tiny_vlm_media import llava_pixels, qwen_pixels, run, text
from hf_prefix_cache.testing.tiny_vlm_parts import IMAGE_ID, VIDEO_ID, VISION_END_ID, VISION_START_ID
from hf_prefix_cache.testing.tiny_vlms import cached_vlm
from tests.batching.test_exactness import run_staggered

#: Every media family the engine joins (`JOINING_MEDIA_TYPES`), as `testing.media.families.Family` builds it.
FAMILIES = (
    # positions count tokens
    "llava", "llava_next", "llava_next_video", "gemma3", "shieldgemma2", "idefics2", "idefics3", "smolvlm",
    "qwen2_audio",
    # M-RoPE
    "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v", "glm4v_moe", "glm46v", "glm_ocr", "glmga", "paddleocr_vl",
)  # fmt: skip
#: Answers never hold placeholder or framing ids (bias -1e9), so a later turn built from one is a valid prompt.
NO_MEDIA_IDS = Sampling(logit_bias=dict.fromkeys(SPECIAL_IDS, -1e9))
# (seed, image seed or None for a text-only row, ends on its image, max_new_tokens, steps run before it joins)
ROWS = ((1, 1, False, 7, 0), (2, 2, False, 9, 2), (3, None, False, 5, 3), (4, 3, True, 6, 3))


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest) -> Family:
    return Family(request.param)


def prompt(fam: Family, seed: int, image: int | None, ends_on_image: bool = False) -> tuple[list[int], dict[str, Any]]:
    """A prompt of text, its image (`image`'s seed; none for text only) and more text, with its media inputs."""
    if image is None:
        ids = text(11 + seed, seed)
        return ids[0].tolist(), {}
    pixels = fam.image(image)
    placeholders = fam.placeholders(pixels)
    if ends_on_image:
        tail = placeholders[:, :-1] if fam.name in FRAMED else placeholders  # the last id a placeholder
        ids = torch.cat([text(4 + seed, seed), tail], dim=1)
    else:
        ids = torch.cat([text(4 + seed, seed), placeholders, text(3 + seed, seed + 50)], dim=1)
    return ids[0].tolist(), fam.kwargs(ids, [pixels])


def generate(model: Any, ids: list[int], inputs: dict[str, Any], new: int, **kwargs: Any) -> Any:
    """`model.generate` on one prompt, greedy, its media ids biased away as the rows' `NO_MEDIA_IDS`."""
    tensor = torch.tensor([ids])
    return model.generate(
        tensor,
        attention_mask=torch.ones_like(tensor),
        max_new_tokens=new,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        sequence_bias={(token,): bias for token, bias in NO_MEDIA_IDS.logit_bias.items()},
        **inputs,
        **kwargs,
    )


def sequential(model: Any, store: PrefixCache, ids: list[int], inputs: dict[str, Any], new: int) -> tuple[Any, int]:
    """The request through `generate` and `store`, as the server runs it one by one: its output and cached tokens."""
    with store.request() as scope:
        out = generate(model, ids, inputs, new, **{CACHE_NAME: store})
    return out, scope.cached_tokens


def test_rows_with_their_own_images_equal_each_request_alone(family: Family) -> None:
    """Three rows with different images and a text-only one, joining at steps 0, 2, 3, 3: tokens equal each
    request's own `generate` (cold and through a store), logits within tolerance, cached tokens as sequential."""
    model = family.model
    batched, one_by_one = PrefixCache(model), PrefixCache(model)
    assert model_alone_reason(store_of(batched).profile) is None  # the scheduler joins this family's rows
    prompts = [prompt(family, seed, image, ends) for seed, image, ends, _, _ in ROWS]
    rows = [
        Row(Request(ids, max_new_tokens=new, sampling=NO_MEDIA_IDS, keep_logits=True, inputs=inputs))
        for (ids, inputs), (*_, new, _) in zip(prompts, ROWS, strict=True)
    ]
    run_staggered(RunningBatch(batched), rows, [after for *_, after in ROWS])
    for (ids, inputs), row, (*_, new, _) in zip(prompts, rows, ROWS, strict=True):
        cold = generate(model, ids, inputs, new)
        assert row.tokens == cold.sequences[0, len(ids) :].tolist()
        assert row.end_reason is EndReason.LENGTH and row.alone_reason is None
        diff = max((a - b[0]).abs().max().item() for a, b in zip(row.logits, cold.logits, strict=True))
        assert diff < LOGIT_TOL
        out, cached = sequential(model, one_by_one, ids, inputs, new)
        assert row.tokens == out.sequences[0, len(ids) :].tolist() and row.cached_tokens == cached
    for store in (batched, one_by_one):
        store.check_integrity()
        store.detach()


def test_a_stored_image_is_reused_and_another_is_not(family: Family) -> None:
    """After the batch stored its rows: the same image again reuses all but the last prompt token, another
    image with the same ids reuses only the text before it, the next turn reuses the whole stored answer;
    every count and token as the sequential path's."""
    model = family.model
    batched, one_by_one = PrefixCache(model), PrefixCache(model)
    first = [prompt(family, seed, image) for seed, image in ((1, 1), (2, 2))]
    turn1 = [Row(Request(ids, 6, sampling=NO_MEDIA_IDS, inputs=inputs)) for ids, inputs in first]
    run_staggered(RunningBatch(batched), turn1, [0, 1])
    for (ids, inputs), row in zip(first, turn1, strict=True):
        assert sequential(model, one_by_one, ids, inputs, 6)[0].sequences[0, len(ids) :].tolist() == row.tokens
    same = first[0]
    other = (
        first[0][0],
        family.kwargs(torch.tensor([first[0][0]]), [family.image(13)]),
    )  # same ids and size, another image
    ids = first[1][0] + turn1[1].tokens + text(5, 60)[0].tolist()
    turn2 = (ids, family.kwargs(torch.tensor([ids]), [family.image(2)]))  # the second row's image, its answer, more
    later = [same, other, turn2]
    rows = [Row(Request(ids, 5, sampling=NO_MEDIA_IDS, inputs=inputs)) for ids, inputs in later]
    run_staggered(RunningBatch(batched), rows, [0, 1, 1])
    for (ids, inputs), row in zip(later, rows, strict=True):
        out, cached = sequential(model, one_by_one, ids, inputs, 5)
        assert row.tokens == out.sequences[0, len(ids) :].tolist()
        assert row.cached_tokens == cached
    head = 5 + (1 if family.name in FRAMED else 0)  # the text before the image (a vision-start id is text)
    assert [row.cached_tokens for row in rows] == [len(same[0]) - 1, head, len(first[1][0]) + 6 - 1]
    for store in (batched, one_by_one):
        store.check_integrity()
        store.detach()


def test_a_media_row_stores_and_reuses_only_under_its_salt() -> None:
    """A finished image row is stored under its salt: its next turn reuses the whole answer under that salt only."""
    fam = Family("qwen2_vl")
    store = PrefixCache(fam.model)
    ids, inputs = prompt(fam, 2, 2)
    first = Row(Request(ids, 4, sampling=NO_MEDIA_IDS, salt="tenant-a", inputs=inputs))
    run_staggered(RunningBatch(store), [first], [0])
    turn2 = ids + first.tokens + text(3, 70)[0].tolist()  # the stored answer, then more text
    inputs2 = fam.kwargs(torch.tensor([turn2]), [fam.image(2)])
    again, other = (Row(Request(turn2, 4, salt=salt, inputs=inputs2)) for salt in ("tenant-a", "tenant-b"))
    run_staggered(RunningBatch(store), [again, other], [0, 0])
    assert again.cached_tokens == len(ids) + len(first.tokens) - 1 and other.cached_tokens == 0
    assert again.tokens == other.tokens
    store.check_integrity()
    store.detach()


def video_prompt(seed: int, ends_on_video: bool) -> tuple[list[int], dict[str, Any]]:
    """A Qwen2-VL prompt of text and a two-frame video (its temporal axis moves), with its media inputs."""
    pixels, grid = qwen_pixels(seed, (2, 4, 4))
    placeholders = [run(VISION_START_ID, 1), run(VIDEO_ID, 8)]
    ids = torch.cat([text(4 + seed, seed), *placeholders, *([] if ends_on_video else [run(VISION_END_ID, 1)])], dim=1)
    if not ends_on_video:
        ids = torch.cat([ids, text(3, seed + 50)], dim=1)
    marks = (ids == IMAGE_ID).int() + 2 * (ids == VIDEO_ID).int()
    return ids[0].tolist(), {"pixel_values_videos": pixels, "video_grid_thw": grid, "mm_token_type_ids": marks}


@pytest.mark.parametrize("name", ["qwen2_vl", "qwen2_5_vl"])
def test_video_rows_join_beside_image_and_text_rows(name: str) -> None:
    """Two video rows (one ending on its video) beside an image row and a text row equal each request alone."""
    fam = Family(name)
    store = PrefixCache(fam.model)
    prompts = [video_prompt(5, False), prompt(fam, 1, 1), video_prompt(6, True), prompt(fam, 3, None)]
    rows = [Row(Request(ids, 5, sampling=NO_MEDIA_IDS, keep_logits=True, inputs=inputs)) for ids, inputs in prompts]
    run_staggered(RunningBatch(store), rows, [0, 1, 1, 2])
    for (ids, inputs), row in zip(prompts, rows, strict=True):
        cold = generate(fam.model, ids, inputs, 5)
        assert row.tokens == cold.sequences[0, len(ids) :].tolist()
        assert max((a - b[0]).abs().max().item() for a, b in zip(row.logits, cold.logits, strict=True)) < LOGIT_TOL
    store.check_integrity()
    store.detach()


def test_the_scheduler_joins_media_rows_and_keeps_unproven_families_alone() -> None:
    """Through the scheduler a Qwen2-VL image row and a text row join (no alone reason); a media model not
    shown exact batched runs each row alone with its media, counted (PaliGemma: `media`; the Qwen2.5-Omni
    thinker: `mrope`), with `generate`'s answer."""
    fam = Family("qwen2_vl")
    store = PrefixCache(fam.model)
    requests = [prompt(fam, 1, 1), prompt(fam, 3, None)]
    scheduler = Scheduler(store)
    rows = [scheduler.submit(Request(ids, 4, sampling=NO_MEDIA_IDS, inputs=inputs)) for ids, inputs in requests]
    scheduler.run_until_idle()
    for (ids, inputs), row in zip(requests, rows, strict=True):
        assert row.alone_reason is None
        assert row.tokens == generate(fam.model, ids, inputs, 4).sequences[0, len(ids) :].tolist()
    store.detach()
    omni = PrefixCache(cached_omni())
    assert model_alone_reason(store_of(omni).profile) == "batch_alone:mrope"
    omni.detach()
    model = cached_vlm("paligemma")
    alone = PrefixCache(model)
    tensor = torch.cat([run(IMAGE_ID, 16), run(1, 1), text(6, 1)], dim=1)  # prefix-LM: the image leads the prompt
    prefix_lm = {"pixel_values": llava_pixels(1)[None], "token_type_ids": torch.zeros_like(tensor)}
    scheduler = Scheduler(alone)
    row = scheduler.submit(Request(tensor[0].tolist(), 4, sampling=NO_MEDIA_IDS, inputs=prefix_lm))
    scheduler.run_until_idle()
    assert row.alone_reason == "batch_alone:media" and alone.stats().fallbacks["batch_alone:media"] == 1
    expected = generate(model, tensor[0].tolist(), prefix_lm, 4).sequences[0, tensor.shape[1] :].tolist()
    assert row.tokens == expected
    alone.detach()


def test_every_family_the_engine_joins_is_proven_here() -> None:
    """`JOINING_MEDIA_TYPES` is exactly the families this file runs batched against their own `generate`."""
    assert set(JOINING_MEDIA_TYPES) == set(FAMILIES)


def test_inputs_must_not_repeat_the_ids() -> None:
    """A processor's whole output passed as `inputs` is refused, naming the keys to drop."""
    with pytest.raises(ValueError, match="input_ids"):
        Request([5, 6], max_new_tokens=2, inputs={"input_ids": torch.tensor([[5, 6]]), "pixel_values": None})
