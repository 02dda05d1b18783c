"""The support matrix's media step: per model type, a tiny media model and two media run through a store.

`scripts/support_matrix.py` runs text prompts only; this module adds, for every model type whose
media an adapter serves, a medium scenario, each step compared with a cold run of the same call
(tokens identical, logits within the sweep's tolerance):

1. cold: text, medium A, text;
2. hit: that prompt, its answer and more text (and, where the family allows, a second medium C);
3. changed: the step-1 prompt with medium B in place of A (same placeholders, other content):
   reuse must stop at or before A's first placeholder;
4. repeat: step 2 again, exactly.

The models and media are the test suite's (`hf_prefix_cache.testing`: `tiny_vlms`, `tiny_qwen_media` and
the family tables of `testing/media/`, Mllama and OneVision included). `MEDIA_CASES` maps an adapter key (a model
type, or ``"<model type>/<vision tower>"`` as `generic_table` keys a tower) to a function giving
its `MediaCase`; adding a family the fixtures build is one line there. Knows nothing about the text
sweep, its workers or the document.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: Prompt ids 100-127 are media and framing ids in every fixture: answers never hold them.
SUPPRESS = list(range(100, 128))
NEW = 4
#: Medium A's and B's pool seeds: the fixtures give seeds 1 and 13 the same shape, other content.
SEED_A, SEED_B, SEED_C = 1, 13, 2


@dataclass(frozen=True)
class MediaCase:
    """A tiny media model and its media "a", "b" (A's placeholders, other content) and maybe "c"."""

    model: Any
    #: Placeholder tokens, framing included, of each medium by name ("c" absent: no second medium).
    tokens: dict[str, Any]
    #: generate kwargs of a prompt `ids` holding the named media in prompt order.
    kwargs: Callable[[Any, Sequence[str]], dict[str, Any]]
    #: Offset in `tokens["a"]` of A's first placeholder (framing before it is text).
    first: int = 0
    #: Text tokens before medium A (0 where media must lead the prompt: PaliGemma).
    head_len: int = 5


@dataclass
class MediaResult:
    """One media scenario's outcome: `status` is served, cold, WRONG, error or not buildable."""

    status: str
    detail: str = ""
    hits: list[int] = field(default_factory=list)

    def cell(self) -> str:
        if self.status == "served":
            return " / ".join(str(h) for h in self.hits)
        return f"{self.status}: {self.detail}" if self.detail else self.status


# --------------------------------------------------------------------------- builders


def _cat(*parts: Any) -> Any:
    import torch

    return torch.cat([p for p in parts if p.shape[1]], dim=1)


def _family(name: str) -> MediaCase:
    """A family of `hf_prefix_cache/testing/media/families.py` (hand-written adapters)."""
    from hf_prefix_cache.testing.media.families import FRAMED, Family

    fam = Family(name)
    media = {"a": fam.image(SEED_A), "b": fam.image(SEED_B), "c": fam.image(SEED_C)}
    tokens = {k: fam.placeholders(m) for k, m in media.items()}
    return MediaCase(
        fam.model, tokens, lambda ids, names: fam.kwargs(ids, [media[n] for n in names]), int(name in FRAMED)
    )


def _generic(name: str) -> MediaCase:
    """A family of `hf_prefix_cache/testing/media/generic.py` (the generic table)."""
    from hf_prefix_cache.testing.media.generic import GenericFamily

    fam = GenericFamily(name)
    media = {"a": fam.medium(SEED_A), "b": fam.medium(SEED_B), "c": fam.medium(SEED_C)}
    tokens = {k: fam.placeholders(m) for k, m in media.items()}
    return MediaCase(
        fam.model, tokens, lambda _ids, names: fam.kwargs([media[n] for n in names]), media["a"].spans[0][0]
    )


def _onevision() -> MediaCase:
    """LLaVA-OneVision (anyres, images as a flat list), as `testing/media/onevision.py` builds it."""
    from hf_prefix_cache.testing.media.onevision import OneVision

    fam = OneVision("tiled")
    media = {"a": fam.image(SEED_A), "b": fam.image(SEED_B), "c": fam.image(SEED_C)}
    tokens = {k: fam.placeholders([m], 0) for k, m in media.items()}
    return MediaCase(fam.model, tokens, lambda _ids, names: fam.kwargs([media[n] for n in names]))


def _paligemma() -> MediaCase:
    """PaliGemma (prefix-LM): images lead the prompt, then BOS; only an identical prompt is reused."""
    import torch

    from hf_prefix_cache.testing.tiny_vlm_media import llava_pixels, run
    from hf_prefix_cache.testing.tiny_vlm_parts import IMAGE_ID
    from hf_prefix_cache.testing.tiny_vlms import cached_vlm

    seeds = {"a": SEED_A, "b": SEED_B}
    tokens = {k: _cat(run(IMAGE_ID, 16), run(1, 1)) for k in seeds}

    def kwargs(ids: Any, names: Sequence[str]) -> dict[str, Any]:
        pixels = torch.stack([llava_pixels(seeds[n]) for n in names])
        return {"pixel_values": pixels, "token_type_ids": torch.zeros_like(ids)}

    return MediaCase(cached_vlm("paligemma"), tokens, kwargs, head_len=0)


def _mllama() -> MediaCase:
    """Mllama (cross-attention) as `testing/media/mllama.py` builds it; a new image reuses nothing: no "c"."""
    from hf_prefix_cache.testing.media.mllama import IMAGE, media, picture, tiny_mllama

    seeds = {"a": SEED_A, "b": SEED_B}
    return MediaCase(
        tiny_mllama(), dict.fromkeys(seeds, IMAGE), lambda ids, names: media(ids, [picture(seeds[n]) for n in names])
    )


def _omni() -> MediaCase:
    """Qwen2.5-Omni thinker: medium A an audio clip (after an audio-start id), C an image."""
    from hf_prefix_cache.testing.tiny_qwen_media import Media, cached_omni, image_tokens, omni_audio_tokens

    frames, grid = 60, (1, 4, 6)
    seeds = {"a": SEED_A, "b": SEED_B}
    tokens = {"a": omni_audio_tokens(frames), "b": omni_audio_tokens(frames), "c": image_tokens(grid)}

    def kwargs(ids: Any, names: Sequence[str]) -> dict[str, Any]:
        clips = [(seeds[n], frames) for n in names if n in seeds]
        images = [(SEED_C, grid)] if "c" in names else []
        return Media(images=images, clips=clips).kwargs(ids)

    return MediaCase(cached_omni(), tokens, kwargs, first=1)


def _gemma4(name: str) -> MediaCase:
    """Gemma 4 / Gemma 4 Unified (`testing/media/gemma4.py`): A an image; C an audio clip, text, then a video."""
    from hf_prefix_cache.testing.media.gemma4 import Gemma4Family

    fam = Gemma4Family(name)
    clip, video = fam.clip(SEED_C), fam.video(SEED_C)
    media = {"a": [fam.image(SEED_A)], "b": [fam.image(SEED_B)], "c": [clip, video]}
    tokens = {k: fam.placeholders(m[0]) for k, m in media.items() if k != "c"}
    tokens["c"] = _cat(fam.placeholders(clip), _text_ids(2, 6), fam.placeholders(video))
    return MediaCase(
        fam.model, tokens, lambda ids, names: fam.kwargs(ids, [m for n in names for m in media[n]]), first=1
    )


def _qwen3(name: str) -> MediaCase:
    """A family of `testing/media/qwen3.py` (Qwen3.5, Qwen3-VL-MoE, ...): A an image; C an image, text, then a video."""
    from hf_prefix_cache.testing.media.qwen3 import Qwen3Family

    fam = Qwen3Family(name)
    image, video = fam.image(SEED_C), fam.video(SEED_C)
    media = {"a": [fam.image(SEED_A)], "b": [fam.image(SEED_B)], "c": [image, video]}
    tokens = {k: fam.placeholders(m[0]) for k, m in media.items() if k != "c"}
    tokens["c"] = _cat(fam.placeholders(image), _text_ids(2, 6), fam.placeholders(video))
    first = fam.first(media["a"][0])
    return MediaCase(
        fam.model, tokens, lambda ids, names: fam.kwargs(ids, [m for n in names for m in media[n]]), first=first
    )


def _grid(name: str) -> MediaCase:
    """A ``"thw"`` table family (`testing/media/grid.py`): A an image; C an image, text, then a video."""
    from hf_prefix_cache.testing.media.grid import GridFamily

    fam = GridFamily(name)
    image, video = fam.image(SEED_C), fam.video(SEED_C)
    media = {"a": [fam.image(SEED_A)], "b": [fam.image(SEED_B)], "c": [image, video]}
    tokens = {k: fam.placeholders(m[0]) for k, m in media.items() if k != "c"}
    tokens["c"] = _cat(fam.placeholders(image), _text_ids(2, 6), fam.placeholders(video))
    return MediaCase(
        fam.model, tokens, lambda ids, names: fam.kwargs(ids, [m for n in names for m in media[n]]), first=1
    )


def _packed(name: str) -> MediaCase:
    """A ``"packed"`` table family (`testing/media/packed.py`): A an image; C another image."""
    from hf_prefix_cache.testing.media.packed import PackedFamily

    fam = PackedFamily(name)
    media = {"a": fam.image(SEED_A), "b": fam.image(SEED_B), "c": fam.image(SEED_C)}
    tokens = {k: fam.placeholders(m) for k, m in media.items()}
    return MediaCase(fam.model, tokens, lambda _ids, names: fam.kwargs([media[n] for n in names]), first=1)


def _nemotron_h_omni() -> MediaCase:
    """Nemotron-H Omni (`testing/media/nemotron_h_omni.py`): A an image; C an audio clip, text, then an image."""
    import hf_prefix_cache.testing.media.nemotron_h_omni as nemotron

    media = {
        "a": [nemotron.image(SEED_A)],
        "b": [nemotron.image(SEED_B)],
        "c": [nemotron.clip(SEED_C), nemotron.image(SEED_C)],
    }
    tokens = {k: nemotron.placeholders(m[0]) for k, m in media.items() if k != "c"}
    tokens["c"] = _cat(nemotron.placeholders(media["c"][0]), _text_ids(2, 6), nemotron.placeholders(media["c"][1]))
    return MediaCase(
        nemotron.tiny_nemotron_h_omni(),
        tokens,
        lambda _ids, names: nemotron.media_kwargs([m for n in names for m in media[n]]),
        1,
    )


def _inkling() -> MediaCase:
    """Inkling (`testing/media/inkling.py`): A an image; C an audio clip, text, then an image."""
    import hf_prefix_cache.testing.media.inkling as inkling

    media = {
        "a": [inkling.image(SEED_A)],
        "b": [inkling.image(SEED_B)],
        "c": [inkling.clip(SEED_C), inkling.image(SEED_C)],
    }
    tokens = {k: inkling.placeholders(m[0]) for k, m in media.items() if k != "c"}
    tokens["c"] = _cat(inkling.placeholders(media["c"][0]), _text_ids(2, 6), inkling.placeholders(media["c"][1]))
    return MediaCase(
        inkling.tiny_inkling(),
        tokens,
        lambda _ids, names: inkling.media_kwargs([m for n in names for m in media[n]]),
        1,
    )


def _phi4() -> MediaCase:
    """Phi-4-multimodal (`testing/media/phi4.py`): A an image; C an audio clip, text, then an image."""
    import hf_prefix_cache.testing.media.phi4 as phi4

    media = {"a": [phi4.image(SEED_A)], "b": [phi4.image(SEED_B)], "c": [phi4.clip(SEED_C), phi4.image(SEED_C)]}
    tokens = {k: phi4.placeholders(m[0]) for k, m in media.items() if k != "c"}
    tokens["c"] = _cat(phi4.placeholders(media["c"][0]), _text_ids(2, 6), phi4.placeholders(media["c"][1]))
    return MediaCase(phi4.cached_phi4(), tokens, lambda _ids, names: phi4.kwargs([m for n in names for m in media[n]]))


def _vibevoice_asr() -> MediaCase:
    """VibeVoice ASR (`testing/media/vibevoice.py`): A a clip, C another; calls pass ``sample=False`` (no noise)."""
    import hf_prefix_cache.testing.media.vibevoice as vibevoice

    media = {"a": vibevoice.Clip(SEED_A), "b": vibevoice.Clip(SEED_B), "c": vibevoice.Clip(SEED_C)}
    tokens = {k: vibevoice.placeholders(m) for k, m in media.items()}
    return MediaCase(
        vibevoice.tiny_vibevoice_asr(),
        tokens,
        lambda _ids, names: vibevoice.media_kwargs([media[n] for n in names]),
        1,
    )


def _emu3() -> MediaCase:
    """Emu3 (`testing/media/emu3.py`): A an image, C another of A's size (so A keeps its padding)."""
    import hf_prefix_cache.testing.media.emu3 as emu3

    media = {"a": emu3.Image(SEED_A), "b": emu3.Image(SEED_B), "c": emu3.Image(SEED_A + 3)}
    tokens = {k: emu3.placeholders(m) for k, m in media.items()}
    return MediaCase(emu3.tiny_emu3(), tokens, lambda _ids, names: emu3.media_kwargs([media[n] for n in names]), 2)


def _ovis2() -> MediaCase:
    """Ovis2 (`testing/media/ovis2.py`): A an image (its global view), C a tiled one; items span their indicators."""
    import hf_prefix_cache.testing.media.ovis2 as ovis2

    media = {"a": ovis2.Image(SEED_A), "b": ovis2.Image(SEED_B), "c": ovis2.Image(SEED_C)}
    tokens = {k: ovis2.placeholders(m) for k, m in media.items()}
    return MediaCase(ovis2.tiny_ovis2(), tokens, lambda _ids, names: ovis2.media_kwargs([media[n] for n in names]))


def _moss() -> MediaCase:
    """MOSS Transcribe-Diarize (`testing/media/moss.py`): A a clip, C a clip of two windows; time markers inside."""
    import hf_prefix_cache.testing.media.moss as moss

    media = {"a": moss.Clip(SEED_A), "b": moss.Clip(SEED_B), "c": moss.Clip(SEED_C)}
    tokens = {k: moss.placeholders(m) for k, m in media.items()}
    return MediaCase(moss.tiny_moss(), tokens, lambda _ids, names: moss.media_kwargs([media[n] for n in names]), 1)


def _kosmos2_5() -> MediaCase:
    """Kosmos-2.5 (`testing/media/kosmos2_5.py`): one image per prompt, leading it (its item spans from BOS): no "c"."""
    import hf_prefix_cache.testing.media.kosmos2_5 as kosmos

    seeds = {"a": SEED_A, "b": SEED_B}
    return MediaCase(
        kosmos.tiny_kosmos2_5(),
        dict.fromkeys(seeds, kosmos.head()),
        lambda ids, names: kosmos.media_kwargs(ids, seeds[names[0]]),
        head_len=0,
    )


def _text_ids(n: int, seed: int) -> Any:
    from hf_prefix_cache.testing.tiny_vlm_media import text

    return text(n, seed)


#: Adapter key -> its case. Keys are those of `multimodal._ADAPTERS` and `generic_table.GENERIC_FAMILIES`.
MEDIA_CASES: dict[str, Callable[[], MediaCase]] = {
    # Hand-written adapters (multimodal/__init__.py `_ADAPTERS`).
    "llava": lambda: _family("llava"),
    "llava_next": lambda: _family("llava_next"),
    "llava_next_video": lambda: _family("llava_next_video"),
    "llava_onevision": _onevision,
    "qwen2_vl": lambda: _family("qwen2_vl"),
    "qwen2_5_vl": lambda: _family("qwen2_5_vl"),
    "qwen3_vl": lambda: _family("qwen3_vl"),
    "gemma3": lambda: _family("gemma3"),
    "shieldgemma2": lambda: _family("shieldgemma2"),
    "paligemma": _paligemma,
    "idefics3": lambda: _family("idefics3"),
    "smolvlm": lambda: _family("smolvlm"),
    "idefics2": lambda: _family("idefics2"),
    "qwen2_audio": lambda: _family("qwen2_audio"),
    "qwen2_5_omni_thinker": _omni,
    "mllama": _mllama,
    "glm4v": lambda: _family("glm4v"),
    "glm4v_moe": lambda: _family("glm4v_moe"),
    "glm46v": lambda: _family("glm46v"),
    "glmga": lambda: _family("glmga"),
    "glm_ocr": lambda: _family("glm_ocr"),
    "paddleocr_vl": lambda: _family("paddleocr_vl"),
    "qwen3_5": lambda: _qwen3("qwen3_5"),
    "qwen3_5_moe": lambda: _qwen3("qwen3_5_moe"),
    "qwen3_vl_moe": lambda: _qwen3("qwen3_vl_moe"),
    "cohere_compass": lambda: _qwen3("cohere_compass"),
    "cosmos3_omni": lambda: _qwen3("cosmos3_omni"),
    "phi4_multimodal": _phi4,
    "gemma4": lambda: _gemma4("gemma4"),
    "gemma4_unified": lambda: _gemma4("gemma4_unified"),
    "emu3": _emu3,
    "ovis2": _ovis2,
    "moss_transcribe_diarize": _moss,
    "kosmos-2.5": _kosmos2_5,
    # The generic table (multimodal/generic_table.py `GENERIC_FAMILIES`).
    "mistral3": lambda: _generic("mistral3"),
    "llava/pixtral": lambda: _generic("llava_pixtral"),
    "lighton_ocr": lambda: _generic("lighton_ocr"),
    "video_llava": lambda: _generic("video_llava"),
    "voxtral": lambda: _generic("voxtral"),
    "glmasr": lambda: _generic("glmasr"),
    "fuyu": lambda: _generic("fuyu"),
    "omniasr": lambda: _generic("omniasr"),
    "internvl": lambda: _generic("internvl"),
    "aya_vision": lambda: _generic("aya_vision"),
    "cohere2_vision": lambda: _generic("cohere2_vision"),
    "qianfan_ocr": lambda: _generic("qianfan_ocr"),
    "got_ocr2": lambda: _generic("got_ocr2"),
    "pp_chart2table": lambda: _generic("pp_chart2table"),
    "deepseek_vl_hybrid": lambda: _generic("deepseek_vl_hybrid"),
    "deepseek_vl": lambda: _generic("deepseek_vl"),
    "janus": lambda: _generic("janus"),
    "vipllava": lambda: _generic("vipllava"),
    "aria": lambda: _generic("aria"),
    "llama4": lambda: _generic("llama4"),
    "lfm2_vl": lambda: _generic("lfm2_vl"),
    "kimi_k25": lambda: _grid("kimi_k25"),
    "mistral_large4": lambda: _generic("mistral_large4"),
    "minimax_m3_vl": lambda: _grid("minimax_m3_vl"),
    "lfm3_vl": lambda: _grid("lfm3_vl"),
    "video_llama_3": lambda: _grid("video_llama_3"),
    "exaone4_5": lambda: _grid("exaone4_5"),
    "hyperclovax_vision_v2": lambda: _grid("hyperclovax_vision_v2"),
    "muse_glimmer": lambda: _grid("muse_glimmer"),
    "minicpm_ocr": lambda: _packed("minicpm_ocr"),
    "nemotron_h_omni": _nemotron_h_omni,
    "inkling_mm_model": _inkling,
    "vibevoice_asr": _vibevoice_asr,
}

#: Adapter keys without a media case, and why.
NO_MEDIA_CASE: dict[str, str] = {
    # Its timm vision tower needs torchvision, which the sweep's environment lacks; its media are proven
    # with .timm-packages by tests/media/test_media_gemma3n.py (run by tests/media/test_gemma3n_env.py).
    "gemma3n": "timm vision tower: tested with .timm-packages, not in the sweep's environment",
}


# --------------------------------------------------------------------------- the scenario


class _Stop(Exception):
    """Ends a scenario early with its result."""

    def __init__(self, status: str, detail: str) -> None:
        super().__init__(detail)
        self.result = MediaResult(status, _short(detail))


def scenario(case: MediaCase, tol: float) -> MediaResult:
    """Cold / hit / changed / repeat of `case` through a fresh store, each against a cold run."""
    import torch

    from hf_prefix_cache import PrefixCache
    from hf_prefix_cache.testing.tiny_vlm_media import text

    if not torch.equal(case.tokens["a"], case.tokens["b"]):
        return MediaResult("error", "fixture: media A and B have different placeholders")
    store = PrefixCache(case.model)
    first = _cat(text(case.head_len, 1), case.tokens["a"], text(6, 2))
    start = case.head_len + case.first  # A's first placeholder: a changed A may reuse only what precedes it
    extra = (case.tokens["c"], text(3, 4)) if "c" in case.tokens else ()
    names = ("a", "c") if extra else ("a",)
    try:
        answer, _ = _step(case, store, first, ("a",), "cold", tol)
        second = _cat(answer, text(4, 3), *extra)
        _, hit = _step(case, store, second, names, "hit", tol)
        _, changed = _step(case, store, first, ("b",), "changed", tol)
        if changed > start:
            raise _Stop("WRONG", f"changed medium reused {changed} tokens, past its first placeholder at {start}")
        _, repeat = _step(case, store, second, names, "repeat", tol)
    except _Stop as stop:
        return stop.result
    finally:
        fallbacks = store.stats().fallbacks
        store.detach()
    if fallbacks:
        return MediaResult("cold", ", ".join(f"`{k}`" for k in sorted(fallbacks)))
    if repeat == 0:
        return MediaResult("WRONG", f"no reuse and no fallback reason (hits {hit} / {changed} / {repeat})")
    return MediaResult("served", hits=[hit, changed, repeat])


def _step(case: MediaCase, store: Any, ids: Any, names: Sequence[str], step: str, tol: float) -> tuple[Any, int]:
    """Run `ids` with media `names` cold and through `store`: (the cached run's sequences, its hit tokens)."""
    import torch

    from hf_prefix_cache.testing.compare import generate, max_logit_diff

    kwargs = {**case.kwargs(ids, names), "suppress_tokens": SUPPRESS}
    before = store.stats().hit_tokens
    try:
        cold = generate(case.model, ids, NEW, **kwargs)
    except Exception as exc:  # noqa: BLE001 - the model cannot run this at all
        raise _Stop("error", f"cold generate ({step}): {type(exc).__name__}: {exc}") from exc
    try:
        warm = generate(case.model, ids, NEW, past_key_values=store, **kwargs)
    except Exception as exc:  # noqa: BLE001 - cold works, the store's run does not: a bug
        raise _Stop("WRONG", f"cached generate raised ({step}): {type(exc).__name__}: {exc}") from exc
    if not torch.equal(cold.sequences, warm.sequences):
        raise _Stop("WRONG", f"tokens differ ({step})")
    diff = max_logit_diff(cold, warm)
    if diff >= tol:
        raise _Stop("WRONG", f"logits differ by {diff:.2e} ({step})")
    return warm.sequences, store.stats().hit_tokens - before


# --------------------------------------------------------------------------- cells of the document


def media_keys(model_type: str) -> list[str]:
    """`MEDIA_CASES` keys of `model_type`: the plain key first, then tower-specific ones."""
    return sorted((k for k in MEDIA_CASES if k.split("/")[0] == model_type), key=lambda k: ("/" in k, k))


def media_cell(model_type: str, tol: float) -> str:
    """The document's media cell of `model_type`: each case's result, tower cases labelled.

    Without a case: ``cold:`` and what serving it would need for a family `generic_table.COLD_FAMILIES`
    names, else "".
    """
    from hf_prefix_cache.multimodal.generic_table import COLD_FAMILIES

    if not media_keys(model_type) and model_type in COLD_FAMILIES:
        return MediaResult("cold", _short(COLD_FAMILIES[model_type])).cell()
    parts = []
    for key in media_keys(model_type):
        try:
            case = MEDIA_CASES[key]()
        except Exception as exc:  # noqa: BLE001 - any build failure is the case's result
            result = MediaResult("not buildable", _short(f"{type(exc).__name__}: {exc}"))
        else:
            try:
                result = scenario(case, tol)
            except Exception as exc:  # noqa: BLE001 - a crash outside generate is recorded too
                result = MediaResult("error", _short(f"{type(exc).__name__}: {exc}"))
        label = f"{key.split('/')[1]} tower: " if "/" in key else ""
        parts.append(label + result.cell())
    return "; ".join(parts)


def media_status(cell: str) -> str:
    """The status a media cell counts as: served, cold, WRONG, other, or "" (no media case)."""
    if not cell:
        return ""
    statuses = set()
    for part in cell.split("; "):
        body = part.split(" tower: ", 1)[-1]
        statuses.add(body.split(":", 1)[0] if ":" in body else "served")
    if "WRONG" in statuses:
        return "WRONG"
    if statuses - {"served", "cold"}:
        return "other"
    return "cold" if "cold" in statuses else "served"


def _short(text: str) -> str:
    text = " ".join(text.split()).replace("|", "/").replace(";", ",")
    return text if len(text) <= 120 else text[:117] + "..."
