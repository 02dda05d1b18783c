"""The bad-input catalogue: unusual or broken arguments to `generate`, each with one allowed outcome.

Every case is a request built from a clean prompt the store already holds, so a wrong reuse
would show. Outcomes:

* ``same``: served or cold, tokens equal a cold run's and logits agree (NaN where cold has NaN);
* ``cold:<reason>``: equal to a cold run and counted under that reason in `stats().fallbacks`;
* ``error``: raises what the cold run raises (same exception type).

After every case the store must still serve the clean prompt exactly, with a hit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from conftest import LOGIT_TOL, assert_same_as_cold, build, distinct_prompt, generate
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.media.families import SPECIAL_IDS, Family
from hf_prefix_cache.testing.tiny_vlm_media import run, text, video_frames
from hf_prefix_cache.testing.tiny_vlm_parts import VIDEO_ID

NEW = 4


@dataclass(frozen=True)
class Case:
    """One request: `make(ids, kwargs)` returns the (ids, kwargs) to send instead of the clean ones."""

    family: str
    name: str
    make: Callable[[torch.Tensor, dict[str, Any]], tuple[Any, dict[str, Any]]]
    outcome: str


class _Base:
    """A family's clean request, held by its store (built once per family)."""

    def __init__(self, family: str) -> None:
        self.family = family
        if family == "llama":
            self.model = build("llama")
            self.ids, self.kwargs = distinct_prompt(7, 24), {}
        elif family == "llava_next_video":
            self.model = Family(family).model
            self.ids = torch.cat([text(8, 1), run(VIDEO_ID, 8), text(3, 2)], dim=1)
            self.kwargs = {"pixel_values_videos": video_frames(5)[None], "suppress_tokens": SPECIAL_IDS}
        else:
            fam = Family(family)
            self.model = fam.model
            item = fam.image(5)
            self.ids = torch.cat([text(8, 1), fam.placeholders(item), text(3, 2)], dim=1)
            self.kwargs = {**fam.kwargs(self.ids, [item]), "suppress_tokens": SPECIAL_IDS}
        self.store = PrefixCache(self.model)
        assert_same_as_cold(self.model, self.ids, self.store, new=NEW, **self.kwargs)


_BASES: dict[str, _Base] = {}


def _base(family: str) -> _Base:
    if family not in _BASES:
        _BASES[family] = _Base(family)
    return _BASES[family]


@pytest.fixture(scope="module", autouse=True)
def _detach_all() -> Any:
    yield
    for base in _BASES.values():
        base.store.detach()
    _BASES.clear()


def _with(**extra: Any) -> Callable[[torch.Tensor, dict[str, Any]], tuple[Any, dict[str, Any]]]:
    return lambda ids, kw: (ids, {**kw, **extra})


def _poke(
    name: str, fn: Callable[[torch.Tensor], Any]
) -> Callable[[torch.Tensor, dict[str, Any]], tuple[Any, dict[str, Any]]]:
    """Replace media kwarg `name` by `fn(its value)` (None drops it)."""

    def make(ids: torch.Tensor, kw: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        out = {**kw, name: fn(kw[name])}
        if out[name] is None:
            del out[name]
        return ids, out

    return make


def _set(value: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def fn(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[0] = value
        return t

    return fn


def _ids(fn: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor, dict[str, Any]], tuple[Any, dict[str, Any]]]:
    return lambda ids, kw: (fn(ids), kw)


def _mask(fn: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor, dict[str, Any]], tuple[Any, dict[str, Any]]]:
    return lambda ids, kw: (ids, {**kw, "attention_mask": fn(torch.ones_like(ids))})


def _left_padded(ids: torch.Tensor, kw: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    rows = torch.cat([ids, torch.cat([torch.zeros(1, 3, dtype=ids.dtype), ids[:, 3:]], dim=1)])
    mask = torch.ones_like(rows)
    mask[1, :3] = 0
    return rows, {**kw, "attention_mask": mask}


def _no_mask_with_pad(ids: torch.Tensor, kw: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    ids = ids.clone()
    ids[0, :2] = 0  # the tiny models' pad id
    return ids, {**kw, "attention_mask": None}


def _inputs_embeds(model: Any) -> Callable[[torch.Tensor, dict[str, Any]], tuple[Any, dict[str, Any]]]:
    return lambda ids, kw: (ids, {**kw, "inputs_embeds": model.get_input_embeddings()(ids).detach()})


_LLAMA = build("llama")
_TEXT_CASES = [
    ("mask_float", _mask(lambda m: m.float()), "same"),
    ("mask_bool", _mask(lambda m: m.bool()), "same"),
    ("mask_int32", _mask(lambda m: m.int()), "same"),
    ("mask_with_zeros", _mask(lambda m: m.index_fill(1, torch.tensor([3]), 0)), "cold:padding"),
    ("mask_all_zeros", _mask(torch.zeros_like), "cold:padding"),
    ("mask_too_short", _mask(lambda m: m[:, :-2]), "error"),
    ("mask_two_rows", _mask(lambda m: m.repeat(2, 1)), "error"),
    ("ids_int32", _ids(lambda i: i.int()), "same"),
    ("ids_float", _ids(lambda i: i.float()), "error"),
    ("ids_1d", _ids(lambda i: i[0]), "error"),
    ("ids_empty", _ids(lambda i: i[:, :0]), "error"),
    ("ids_out_of_vocab", _ids(lambda i: i.index_fill(1, torch.tensor([4]), 10_000)), "error"),
    ("ids_negative", _ids(lambda i: i.index_fill(1, torch.tensor([4]), -3)), "error"),
    ("ids_meta_device", _ids(lambda i: i.to("meta")), "error"),
    ("ids_one_token", _ids(lambda i: i[:, :1]), "same"),
    ("ids_huge", _ids(lambda i: i.repeat(1, 25)), "same"),
    ("ids_prefix_of_stored", _ids(lambda i: i[:, :10]), "same"),
    ("batch_two_equal_rows", _ids(lambda i: i.repeat(2, 1)), "same"),
    ("batch_left_padded", _left_padded, "same"),
    ("pad_in_prompt_no_mask", _no_mask_with_pad, "cold:padding"),
    ("inputs_embeds", _inputs_embeds(_LLAMA), "cold:inputs_embeds"),
    ("position_ids", _with(position_ids=torch.arange(24)[None]), "cold:explicit_position_ids"),
    ("token_type_ids", _with(token_type_ids=torch.zeros(1, 24, dtype=torch.long)), "error"),
    ("misspelt_kwarg", _with(max_new_tokns=3), "error"),
    ("num_beams", _with(num_beams=2), "same"),
    ("num_return_sequences", _with(num_return_sequences=2), "error"),
    ("use_cache_false", _with(use_cache=False), "cold:use_cache_false"),
    ("prompt_lookup", _with(prompt_lookup_num_tokens=2), "same"),
    ("output_attentions", _with(output_attentions=True), "cold:output_attentions"),
    ("output_hidden_states", _with(output_hidden_states=True), "cold:output_hidden_states"),
    ("cache_implementation_static", _with(cache_implementation="static"), "same"),
    ("cache_implementation_bogus", _with(cache_implementation="bogus"), "error"),
    (
        "generation_config_beams",
        _with(generation_config=GenerationConfig(num_beams=2, max_new_tokens=NEW)),
        "same",
    ),
    ("max_new_tokens_zero", _with(max_new_tokens=0), "error"),
    ("max_new_tokens_negative", _with(max_new_tokens=-1), "error"),
    ("min_new_tokens", _with(min_new_tokens=3), "same"),
    ("repetition_penalty", _with(repetition_penalty=1.3), "same"),
    ("bad_words_ids", _with(bad_words_ids=[[5], [6, 7]]), "same"),
    ("eos_token_list", _with(eos_token_id=[120, 121]), "same"),
    ("empty_logits_processor", _with(logits_processor=LogitsProcessorList()), "same"),
    ("empty_stopping_criteria", _with(stopping_criteria=StoppingCriteriaList()), "same"),
    ("temperature_zero_sampling", _with(do_sample=True, temperature=0.0), "error"),
    ("negative_prompt", _with(negative_prompt_ids=torch.tensor([[5, 6]])), "cold:negative_prompt"),
]

_MEDIA_CASES = [
    ("llava", "pixels_nan", _poke("pixel_values", _set(float("nan"))), "same"),
    ("llava", "pixels_inf", _poke("pixel_values", _set(float("inf"))), "same"),
    ("llava", "pixels_float64", _poke("pixel_values", lambda t: t.double()), "same"),
    ("llava", "pixels_float16", _poke("pixel_values", lambda t: t.half()), "same"),
    ("llava", "pixels_int", _poke("pixel_values", lambda t: t.long()), "same"),
    ("llava", "pixels_missing", _poke("pixel_values", lambda t: None), "cold:media_placeholders"),
    ("llava", "pixels_empty", _poke("pixel_values", lambda t: t[:0]), "error"),
    ("llava", "pixels_two_images_one_run", _poke("pixel_values", lambda t: t.repeat(2, 1, 1, 1)), "error"),
    ("llava", "pixels_wrong_size", _poke("pixel_values", lambda t: t[..., :16, :16]), "error"),
    ("llava", "pixels_meta_device", _poke("pixel_values", lambda t: t.to("meta")), "error"),
    ("llava", "pixels_as_list", _poke("pixel_values", lambda t: [t[0]]), "error"),
    ("qwen2_audio", "audio_nan", _poke("input_features", _set(float("nan"))), "same"),
    ("qwen2_audio", "audio_inf", _poke("input_features", _set(float("-inf"))), "same"),
    ("qwen2_audio", "audio_no_frame_mask", _poke("feature_attention_mask", lambda t: None), "error"),
    ("qwen2_audio", "audio_frames_cut", _poke("input_features", lambda t: t[..., :50]), "error"),
    ("qwen2_audio", "audio_float64", _poke("input_features", lambda t: t.double()), "same"),
    ("llava_next_video", "video_nan", _poke("pixel_values_videos", _set(float("nan"))), "same"),
    ("llava_next_video", "video_one_frame", _poke("pixel_values_videos", lambda t: t[:, :1]), "error"),
    ("llava_next_video", "video_empty", _poke("pixel_values_videos", lambda t: t[:0]), "error"),
    ("qwen2_vl", "grid_wrong", _poke("image_grid_thw", lambda t: t * torch.tensor([[1, 2, 1]])), "error"),
    ("qwen2_vl", "grid_missing", _poke("image_grid_thw", lambda t: None), "error"),
    ("qwen2_vl", "rows_nan", _poke("pixel_values", _set(float("nan"))), "same"),
    (
        "qwen2_vl",
        "mm_token_type_ids_missing",
        _poke("mm_token_type_ids", lambda t: None),
        "cold:mm_token_type_ids_missing",
    ),
]

CASES = [Case("llama", name, make, outcome) for name, make, outcome in _TEXT_CASES] + [
    Case(family, name, make, outcome) for family, name, make, outcome in _MEDIA_CASES
]


def _same_outputs(cold: Any, warm: Any) -> None:
    assert torch.equal(cold.sequences, warm.sequences), f"tokens differ:\n{cold.sequences}\n{warm.sequences}"
    for a, b in zip(cold.logits, warm.logits, strict=True):
        assert torch.equal(a.isnan(), b.isnan())
        finite = a.isfinite() & b.isfinite()
        assert torch.equal(a[~finite], b[~finite]) or bool(a[~finite].isnan().all())
        diff = (a[finite] - b[finite]).abs().max().item() if finite.any() else 0.0
        assert diff < LOGIT_TOL, f"logits differ by {diff}"


def test_the_catalogue_has_at_least_forty_cases() -> None:
    """The catalogue covers at least 40 cases, each with a distinct name."""
    assert len(CASES) >= 40
    assert len({(c.family, c.name) for c in CASES}) == len(CASES)


def _run(case: Case, base: _Base, ids: Any, kwargs: dict[str, Any]) -> None:
    """One request through the store, checked against a cold run for the case's outcome."""
    model, store = base.model, base.store
    before = dict(store.stats().fallbacks)
    cold_error: Exception | None = None
    try:
        cold = generate(model, ids, NEW, **kwargs)
    except Exception as exc:
        cold_error = exc
    if cold_error is not None:
        assert case.outcome == "error", f"cold run raised {cold_error!r}; expected {case.outcome}"
        with pytest.raises(type(cold_error)):
            generate(model, ids, NEW, past_key_values=store, **kwargs)
        return
    assert case.outcome != "error", "the cold run did not raise"
    warm = generate(model, ids, NEW, past_key_values=store, **kwargs)
    _same_outputs(cold, warm)
    after = store.stats().fallbacks
    new_reasons = {k for k, v in after.items() if v > before.get(k, 0)} - {"non_finite_states"}
    if case.outcome.startswith("cold:"):
        assert new_reasons == {case.outcome[5:]}, after
    else:
        assert not new_reasons, after


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.family}-{c.name}")
def test_bad_input(case: Case) -> None:
    """The case has its one allowed outcome on an empty and on a primed store, and the store stays exact after."""
    base = _base(case.family)
    model, store = base.model, base.store
    ids, kwargs = case.make(base.ids, dict(base.kwargs))
    # On an empty store: what the case stores must not change a clean request sharing its first tokens.
    store.clear()
    _run(case, base, ids, kwargs)
    sibling = torch.cat([base.ids[:, :8], text(6, 11)], dim=1)
    assert_same_as_cold(model, sibling, store, new=NEW)
    # On a store holding the clean request: the case must not reuse what does not fit it.
    assert_same_as_cold(model, base.ids, store, new=NEW, **base.kwargs)
    _run(case, base, ids, kwargs)
    hits = store.stats().hit_tokens
    assert_same_as_cold(model, base.ids, store, new=NEW, **base.kwargs)
    assert store.stats().hit_tokens > hits, "the clean prompt is no longer reused"
    store.check_integrity()
