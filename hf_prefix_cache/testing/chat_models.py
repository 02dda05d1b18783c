"""Tiny random-weight media models with real processors, built offline, for trying media in the front ends.

The Gradio chat, the notebooks and the serve tests load them (`hf_prefix_cache.frontends.tiny_vlm`
names them for the front ends).

`load_tiny_vlm`: transformers' `LlavaProcessor` with its PIL image processor (images resized
and cropped to 32x32) and SmolLM2's tokenizer (from `hf_prefix_cache.api.models`) plus an
``<image>`` token; a 2-layer Llama text model with a 2-layer CLIP vision tower.
`load_tiny_audio_lm`: `Qwen2AudioProcessor` with a `WhisperFeatureExtractor` (16 mel bins,
1-second windows) and the same tokenizer plus audio tokens; a 2-layer Qwen2 text model with a
2-layer audio encoder. Random weights write noise, but exercise the whole media path
(placeholders, media hashes, reuse of a stored image or clip) as a trained model would.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_prefix_cache.testing.tiny_build import _ATTN
from hf_prefix_cache.testing.tiny_vlm_parts import _CLIP


def chat_template(media_type: str, placeholder: str) -> str:
    """A ChatML-style template that writes `placeholder` for each content block of `media_type`."""
    return (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
        f"{{% for c in m.content %}}{{% if c.type == '{media_type}' %}}{placeholder}"
        "{% elif c.type == 'text' %}{{ c.text }}{% endif %}"
        "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def _tokenizer(special: list[str]) -> Any:
    from transformers import AutoTokenizer

    from hf_prefix_cache.api.models import smollm2_folder

    tokenizer = AutoTokenizer.from_pretrained(smollm2_folder())
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    return tokenizer


def _text_config(tokenizer: Any, model_type: str) -> dict[str, Any]:
    return {
        **_ATTN,
        "model_type": model_type,
        "vocab_size": len(tokenizer),
        "num_hidden_layers": 2,
        "max_position_embeddings": 2048,
        "eos_token_id": tokenizer.eos_token_id,
    }


def _finish(model_cls: Any, config: Any, tokenizer: Any, seed: int) -> Any:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_cls(config)
    model.eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def load_tiny_vlm(seed: int = 0) -> tuple[Any, Any]:
    """A random-weight tiny LLaVA (float32, eval mode) and its real `LlavaProcessor`.

    Returns:
        `(model, processor)`; every 32x32 image becomes 16 ``<image>`` placeholders.

    Raises:
        ModelUnavailableError: SmolLM2's tokenizer cannot be loaded (see `hf_prefix_cache.api.models`).

    >>> model, processor = load_tiny_vlm()                                  # doctest: +SKIP
    """
    import transformers

    tokenizer = _tokenizer(["<image>"])
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    assert isinstance(image_id, int), image_id
    processor = transformers.LlavaProcessor(  # type: ignore[no-untyped-call]
        image_processor=transformers.LlavaImageProcessorPil(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        ),
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token="<image>",
        chat_template=chat_template("image", "<image>"),
    )
    config = transformers.LlavaConfig(
        text_config=_text_config(tokenizer, "llama"),
        vision_config=_CLIP,
        image_token_index=image_id,
        vision_feature_layer=-1,
    )
    return _finish(transformers.LlavaForConditionalGeneration, config, tokenizer, seed), processor


def load_tiny_audio_lm(seed: int = 0) -> tuple[Any, Any]:
    """A random-weight tiny Qwen2-Audio (float32, eval mode) and its real `Qwen2AudioProcessor`.

    Clips are 16 kHz mono (the caller resamples) and the processor keeps their first second:
    100 mel frames, which become 25 ``<|AUDIO|>`` placeholders.

    Raises:
        ModelUnavailableError: SmolLM2's tokenizer cannot be loaded (see `hf_prefix_cache.api.models`).

    >>> model, processor = load_tiny_audio_lm()                             # doctest: +SKIP
    """
    import transformers

    tokenizer = _tokenizer(["<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"])
    audio_id = tokenizer.convert_tokens_to_ids("<|AUDIO|>")
    assert isinstance(audio_id, int), audio_id
    features = transformers.WhisperFeatureExtractor(  # type: ignore[no-untyped-call]
        feature_size=16, sampling_rate=16000, hop_length=160, chunk_length=1, n_fft=400
    )
    processor = transformers.Qwen2AudioProcessor(  # type: ignore[no-untyped-call]
        feature_extractor=features,
        tokenizer=tokenizer,
        chat_template=chat_template("audio", "<|audio_bos|><|AUDIO|><|audio_eos|>"),
    )
    audio = {
        "model_type": "qwen2_audio_encoder",
        "d_model": 32,
        "encoder_layers": 2,
        "encoder_attention_heads": 4,
        "encoder_ffn_dim": 64,
        "num_mel_bins": 16,
        "max_source_positions": 50,
    }
    config = transformers.Qwen2AudioConfig(
        text_config=_text_config(tokenizer, "qwen2"), audio_config=audio, audio_token_index=audio_id
    )
    return _finish(transformers.Qwen2AudioForConditionalGeneration, config, tokenizer, seed), processor
