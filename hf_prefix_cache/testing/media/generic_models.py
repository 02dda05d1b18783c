"""The tiny generic families by name: their builders, which hold text-layer states, and one model of each per session."""

from __future__ import annotations

from typing import Any

import transformers

from hf_prefix_cache.testing.media.generic_audio import tiny_glmasr, tiny_omniasr, tiny_voxtral
from hf_prefix_cache.testing.media.generic_downsampled import tiny_chameleon, tiny_step3p7
from hf_prefix_cache.testing.media.generic_images import (
    tiny_deepseek_vl,
    tiny_deepseek_vl_hybrid,
    tiny_fuyu,
    tiny_got_ocr2,
    tiny_janus,
    tiny_lfm2_vl,
    tiny_lighton_ocr,
    tiny_llava_pixtral,
    tiny_mistral3,
    tiny_mistral_large4,
    tiny_video_llava,
    tiny_vipllava,
)
from hf_prefix_cache.testing.media.generic_tiles import (
    tiny_aria,
    tiny_aya_vision,
    tiny_cohere2_vision,
    tiny_internvl,
    tiny_llama4,
    tiny_qianfan_ocr,
)
from hf_prefix_cache.testing.tiny_build import one_model
from hf_prefix_cache.testing.tiny_vlms import cached_vlm

_BUILDERS = {
    "mistral3": tiny_mistral3,
    "llava_pixtral": tiny_llava_pixtral,
    "video_llava": tiny_video_llava,
    "voxtral": tiny_voxtral,
    "glmasr": tiny_glmasr,
    "fuyu": tiny_fuyu,
    # OmniASR is new in transformers 5.24.
    **({"omniasr": tiny_omniasr} if hasattr(transformers, "OmniASRConfig") else {}),
    "internvl": tiny_internvl,
    "aya_vision": tiny_aya_vision,
    "llama4": tiny_llama4,
    "lighton_ocr": tiny_lighton_ocr,
    "cohere2_vision": tiny_cohere2_vision,
    "got_ocr2": tiny_got_ocr2,
    "pp_chart2table": lambda: tiny_got_ocr2(transformers.PPChart2TableConfig),
    "deepseek_vl_hybrid": tiny_deepseek_vl_hybrid,
    "deepseek_vl": tiny_deepseek_vl,
    "qianfan_ocr": tiny_qianfan_ocr,
    "aria": tiny_aria,
    "janus": tiny_janus,
    "lfm2_vl": tiny_lfm2_vl,
    "mistral_large4": tiny_mistral_large4,
    "vipllava": tiny_vipllava,
    "chameleon": tiny_chameleon,
    "step3p7": tiny_step3p7,
}
#: Generic families whose text layers hold states: each prefix restores only at a snapshot.
STATE_FAMILIES = ("lfm2_vl",)
#: Attention-only families served by `GenericMedia`, plus SmolVLM's videos through its own adapter.
GENERIC_FAMILIES = (*(name for name in _BUILDERS if name not in STATE_FAMILIES), "smolvlm_video")


def cached_generic(name: str) -> Any:
    """One model per family per session."""
    return cached_vlm("smolvlm") if name == "smolvlm_video" else one_model(_BUILDERS[name])
