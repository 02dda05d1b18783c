"""The families `GenericMedia` serves: one `FamilyRule` per family, keyed by model type.

A key ``"<model_type>/<vision model_type>"`` picks a rule for one tower of a family
(LLaVA with a Pixtral tower); a plain ``"<model_type>"`` key covers the family otherwise.
Each row was checked against transformers 5.23 (each item is encoded on its own and its
features fill its placeholders in order; OmniASR against 5.24, which added it) and is proven
exact by `tests/media/test_media_generic.py` (LFM2-VL, whose text layers hold conv states, by
`tests/media/test_media_lfm2_vl.py`; the ``"thw"`` rows, Kimi-K2.5 on, by `tests/media/test_media_grid.py`;
MiniCPM-o OCR, Nemotron-H Omni and Inkling, whose text layers hold states, by
`tests/media/test_media_minicpm.py`, `tests/media/test_media_nemotron_h_omni.py` and
`tests/media/test_media_inkling.py`; VibeVoice ASR, whose calls must pass `sample=False`, by
`tests/media/test_media_vibevoice.py`; the speech LMs, Granite Speech on, by `tests/media/test_media_speech_lms.py`
and the family suite; Gemma 3n, whose timm tower needs torchvision, by
`tests/media/test_media_gemma3n.py` in its own venv, as are FastVLM and Perception LM, by
`tests/media/test_media_timm_towers.py`; Muse Spark, Inkling 2 (and its loop variant), Apertus 1.5
and dots3 Note by the family suite, `tests/media/test_media_families.py`). Families left out, and
why, are listed in `COLD_FAMILIES`. Each key here is registered as its own row of `registry` (a
generic family's row is its rule in this table; a cold family's, its reason).
"""

from __future__ import annotations

from functools import partial
from typing import Any

from hf_prefix_cache.multimodal.generic import GenericMedia
from hf_prefix_cache.multimodal.generic_rules import FamilyRule
from hf_prefix_cache.multimodal.generic_table_patches import PATCH_FAMILIES
from hf_prefix_cache.multimodal.generic_table_rows import ROW_FAMILIES
from hf_prefix_cache.multimodal.registry import MediaFamily, register

#: The one table `GenericMedia` serves from: the families whose items are whole rows
#: (`generic_table_rows`), then those whose items are spans of flattened patches (`generic_table_patches`).
GENERIC_FAMILIES: dict[str, FamilyRule] = {**ROW_FAMILIES, **PATCH_FAMILIES}

#: Families left cold on media that were examined, and what serving them would need (their media
#: requests count `media_inputs:<model_type>`). Documentation as data: the store never reads it;
#: the support matrix shows it in the media column.
COLD_FAMILIES: dict[str, str] = {
    # MiniCPM-V 4.6: MiniCPM-o OCR's model, in "16x" mode by default: the tower's window merger runs over all
    # images of a call packed together, so an image's features depend on the images before it
    # (`tests/media/test_media_minicpm.py`). Serving it would need a layout whose items are whole prompts' images.
    "minicpmv4_6": "16x mode (the default): an image's features depend on the images packed before it",
    # GIT: the image's features are prepended before the prompt's embeddings (no placeholder ids; the
    # cache holds positions the prompt has no ids for) and attend both ways.
    "git": "image tokens are prepended outside input_ids (the cache is longer than the prompt)",
    # Molmo 2: with the processor's `mm_token_type_ids` all image (and frame) placeholders of a prompt form one
    # bidirectional attention block, so an image's states change with every image after it
    # (`tests/media/test_media_cold_families.py`). Serving it would need whole-prompt media keys.
    "molmo2": "all images of a prompt attend to each other both ways: an image's states depend on the images after it",
    # Qwen4-Exp: Qwen3-VL-style M-RoPE with a fourth (text) position row, gated delta-net layers whose media
    # prefill must be fed embeddings, and an indexer keeping the prompt's positions: none of this is in the generic
    # rules; serving it would need its own adapter (Qwen3.5's, with those positions).
    "qwen4_exp": "needs its own adapter: 4-row M-RoPE positions, recurrent layers fed media embeddings, an indexer",
}


def generic_adapter(rule: FamilyRule, model: Any) -> GenericMedia | None:
    """`model`'s adapter from `rule`; None (its media cold) when its config breaks the rule's assumptions."""
    return GenericMedia(model, rule) if rule.fits(model.config) else None


for _key, _rule in GENERIC_FAMILIES.items():
    register(MediaFamily((_key,), partial(generic_adapter, _rule)))
for _key, _reason in COLD_FAMILIES.items():
    register(MediaFamily((_key,), None, cold=_reason))
