"""The support matrix's media step: per model type, a tiny media model and two media run through a store.

`scripts/support_matrix.py` runs text prompts only; this module adds, for every model type whose
media an adapter serves, a medium scenario, each step compared with a cold run of the same call
(tokens identical, logits within the sweep's tolerance):

1. cold: text, medium A, text;
2. hit: that prompt, its answer and more text (and, where the family allows, a second medium C);
3. changed: the step-1 prompt with medium B in place of A (same placeholders, other content):
   reuse must stop at or before A's first placeholder;
4. repeat: step 2 again, exactly.

The models and media are the test suite's: each builder module of `hf_prefix_cache/testing/media/`
registers its family's case (`testing.media.registry.SweepCase`) under the family's key in the media
registry (a model type, or ``"<model type>/<vision tower>"`` for a tower), and `media_cases` reads
them all; a new family adds nothing here. Knows nothing about the text sweep, its workers or the
document.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hf_prefix_cache.testing.media.registry import SweepCase as MediaCase

#: Prompt ids 100-127 are media and framing ids in every fixture: answers never hold them (nor a case's
#: `suppress` ids).
SUPPRESS = list(range(100, 128))
NEW = 4


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


# --------------------------------------------------------------------------- cases


@functools.cache
def media_cases() -> dict[str, Callable[[], MediaCase]]:
    """Family key -> its case: the test-builder registry's (`hf_prefix_cache/testing/media/registry.py`)."""
    from hf_prefix_cache.testing.media import registry

    return registry.sweep_cases()


def _cat(*parts: Any) -> Any:
    from hf_prefix_cache.testing.media.registry import cat

    return cat(*parts)


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

    kwargs = {**case.kwargs(ids, names), "suppress_tokens": SUPPRESS + list(case.suppress)}
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
    """`media_cases` keys of `model_type`: the plain key first, then tower-specific ones."""
    return sorted((k for k in media_cases() if k.split("/")[0] == model_type), key=lambda k: ("/" in k, k))


def media_cell(model_type: str, tol: float) -> str:
    """The document's media cell of `model_type`: each case's result, tower cases labelled.

    Without a case: ``cold:`` and what serving it would need for a family the media registry
    names cold, else "".
    """
    from hf_prefix_cache.multimodal import registry

    cold = registry.cold()
    if not media_keys(model_type) and model_type in cold:
        return MediaResult("cold", _short(cold[model_type])).cell()
    parts = []
    for key in media_keys(model_type):
        try:
            case = media_cases()[key]()
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
