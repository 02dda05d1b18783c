"""The chat engines the front ends offer by name: the real SmolLM2, the tiny VLM and audio model, or a path.

`gradio` and `chat` share this table, so both take the same model names and both fail the same
way (a `ModelUnavailableError` naming what to install) when the real model is missing.
"""

from __future__ import annotations

from hf_prefix_cache.frontends.chat import ChatEngine

DEFAULT_MODEL = "smollm2"
TINY_VLM = "tiny-vlm"
TINY_AUDIO = "tiny-audio"

#: What the page says of each tiny random-weight engine (`frontends.tiny_vlm` builds them).
_TINY_NOTES = {
    TINY_VLM: (
        "A tiny LLaVA with **random weights** and a real processor: its answers are noise. "
        "Upload images and watch the cache panel: a stored image is reused, not encoded again."
    ),
    TINY_AUDIO: (
        "A tiny Qwen2-Audio with **random weights** and a real processor: its answers are noise. "
        "Upload WAV clips (their first second is used) and watch the cache panel: a stored clip is reused."
    ),
}


def load_engine(model: str = DEFAULT_MODEL, max_new_tokens: int = 64) -> tuple[ChatEngine, str]:
    """The engine for `model` and a note for the page.

    Args:
        model: ``"smollm2"`` (the real SmolLM2-135M-Instruct, offline), ``"tiny-vlm"`` (a
            random-weight LLaVA with a real processor), ``"tiny-audio"`` (a random-weight
            Qwen2-Audio with a real processor) or a hub id / local folder.
        max_new_tokens: answer length limit.
    """
    if model == DEFAULT_MODEL:
        from hf_prefix_cache.api.models import load_smollm2

        lm, tokenizer = load_smollm2()
        return ChatEngine(lm, tokenizer, max_new_tokens=max_new_tokens), "SmolLM2-135M-Instruct (text only)."
    if model in _TINY_NOTES:
        from hf_prefix_cache.frontends.tiny_vlm import load_tiny_audio_lm, load_tiny_vlm

        tiny, processor = load_tiny_vlm() if model == TINY_VLM else load_tiny_audio_lm()
        return ChatEngine(tiny, processor, max_new_tokens=max_new_tokens), _TINY_NOTES[model]
    return _engine_for_path(model, max_new_tokens), f"{model}."


def _engine_for_path(name: str, max_new_tokens: int) -> ChatEngine:
    from transformers import AutoProcessor

    from hf_prefix_cache.api.models import load_model

    processor = None
    try:
        processor = AutoProcessor.from_pretrained(name)  # type: ignore[no-untyped-call]
    except Exception:  # a text model may have no processor; its tokenizer serves
        processor = None
    if processor is not None and getattr(processor, "image_processor", None) is not None:
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_pretrained(name).eval()  # type: ignore[no-untyped-call]
        return ChatEngine(model, processor, max_new_tokens=max_new_tokens)
    model, tokenizer = load_model(name)
    return ChatEngine(model, tokenizer, max_new_tokens=max_new_tokens)
