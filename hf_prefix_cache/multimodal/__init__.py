"""Media adapters per model family, and the lookup from a model to its adapter.

One module per family (`llava`, `llava_next`, `llava_onevision`, `idefics`, `qwen_vl`, `qwen_audio`,
`qwen_omni`, `glm4v`, `mllama`, `gemma4`, `phi4`, `emu3`, `ovis2`, `moss`, `kosmos2_5`); the base class
and shared helpers live in `base`. Families of the common pattern (rows of a media kwarg scattered over
placeholders) are rows of `generic_table`, served by `generic.GenericMedia`; a tower-specific row there
(``"llava/pixtral"``) wins over the family's module. A family missing here runs cold on media
inputs, with the reason `media_inputs:<model_type>`.
"""

from __future__ import annotations

from typing import Any

from hf_prefix_cache.multimodal.base import MEDIA_KWARGS, MediaAdapter
from hf_prefix_cache.multimodal.emu3 import Emu3Media
from hf_prefix_cache.multimodal.gemma4 import Gemma4Media, Gemma4UnifiedMedia
from hf_prefix_cache.multimodal.generic import GenericMedia
from hf_prefix_cache.multimodal.generic_table import GENERIC_FAMILIES, generic_key
from hf_prefix_cache.multimodal.glm4v import Glm4vMedia, PaddleOcrVlMedia
from hf_prefix_cache.multimodal.idefics import Idefics3Media
from hf_prefix_cache.multimodal.kosmos2_5 import Kosmos2_5Media
from hf_prefix_cache.multimodal.llava import Gemma3Media, LlavaMedia, PaliGemmaMedia
from hf_prefix_cache.multimodal.llava_next import LlavaNextMedia, LlavaNextVideoMedia
from hf_prefix_cache.multimodal.llava_onevision import LlavaOnevisionMedia
from hf_prefix_cache.multimodal.mllama import MllamaMedia
from hf_prefix_cache.multimodal.moss import MossTranscribeDiarizeMedia
from hf_prefix_cache.multimodal.ovis2 import Ovis2Media
from hf_prefix_cache.multimodal.phi4 import Phi4MultimodalMedia
from hf_prefix_cache.multimodal.qwen_audio import Qwen2AudioMedia
from hf_prefix_cache.multimodal.qwen_omni import Qwen2_5OmniThinkerMedia
from hf_prefix_cache.multimodal.qwen_vl import Qwen2_5VLMedia, Qwen2VLMedia, Qwen3_5Media, Qwen3VLMedia

__all__ = ["MEDIA_KWARGS", "MediaAdapter", "media_adapter_for"]

_ADAPTERS: dict[str, type[MediaAdapter]] = {
    "llava": LlavaMedia,
    "gemma3": Gemma3Media,
    # ShieldGemma 2 generates with Gemma 3's class under its own config (its classifier wraps that model).
    "shieldgemma2": Gemma3Media,
    "paligemma": PaliGemmaMedia,
    "llava_next": LlavaNextMedia,
    "llava_next_video": LlavaNextVideoMedia,
    "llava_onevision": LlavaOnevisionMedia,
    "qwen2_vl": Qwen2VLMedia,
    "qwen2_5_vl": Qwen2_5VLMedia,
    "qwen3_vl": Qwen3VLMedia,
    "qwen3_vl_moe": Qwen3VLMedia,
    # Qwen3-VL's tower, placeholders and `get_rope_index`: Cohere Compass on Cohere 2 text layers,
    # Cosmos 3 Omni (its reasoner) under its own config.
    "cohere_compass": Qwen3VLMedia,
    "cosmos3_omni": Qwen3VLMedia,
    "qwen3_5": Qwen3_5Media,
    "qwen3_5_moe": Qwen3_5Media,
    "glm4v": Glm4vMedia,
    "glm4v_moe": Glm4vMedia,
    "glm46v": Glm4vMedia,
    "glmga": Glm4vMedia,
    "glm_ocr": Glm4vMedia,
    "paddleocr_vl": PaddleOcrVlMedia,
    "qwen2_audio": Qwen2AudioMedia,
    "qwen2_5_omni_thinker": Qwen2_5OmniThinkerMedia,
    "idefics3": Idefics3Media,
    "smolvlm": Idefics3Media,
    "idefics2": Idefics3Media,
    "mllama": MllamaMedia,
    "phi4_multimodal": Phi4MultimodalMedia,
    "gemma4": Gemma4Media,
    "gemma4_unified": Gemma4UnifiedMedia,
    "emu3": Emu3Media,
    "ovis2": Ovis2Media,
    "moss_transcribe_diarize": MossTranscribeDiarizeMedia,
    "kosmos-2.5": Kosmos2_5Media,
}


def media_adapter_for(model: Any) -> MediaAdapter | None:
    """The adapter of `model`'s family, or None when its media cannot be served exactly."""
    key = generic_key(model.config)
    if key is not None:
        # A family declared as data; one whose config breaks the rule's assumptions stays cold.
        rule = GENERIC_FAMILIES[key]
        return GenericMedia(model, rule) if rule.fits(model.config) else None
    cls = _ADAPTERS.get(getattr(model.config, "model_type", ""))
    return cls(model) if cls is not None else None
