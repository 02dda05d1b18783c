"""Tiny random-weight vision-language models and their media, built offline from config classes.

Each builder seeds ``torch.manual_seed(0)`` and returns an eval-mode float32 model with eager
attention whose generation never stops early (see ``tiny_build._finalize``). Text ids come
from ``random_prompt`` (``[4, 100)``); placeholders use ids above 100:

* ``llava``: CLIP vision tower (32x32 images, 8x8 patches): 16 placeholders per image.
* ``llava_next``: the same tower with anyres tiling (pinpoints up to 64x64); an image's
  placeholder count depends on its size (``llava_next_tokens``). Pixels come from the real
  ``LlavaNextImageProcessorPil``, which pads every prompt's patch stacks to its largest image.
* ``qwen2_vl``: M-RoPE text model; an image of grid ``(t, h, w)`` is ``t*h*w`` rows of
  ``3*2*2*2`` values and ``t*h*w/4`` placeholders between vision start/end ids.
* ``glm4v``, ``glm4v_moe``, ``glm46v``, ``glmga``, ``glm_ocr``: Qwen2-VL's patch layout; a video's
  frames are image placeholders between ``VIDEO_START_ID`` and ``VIDEO_END_ID`` (``glm_video_tokens``),
  marked by ``glm_marks``. ``paddleocr_vl``: images only, patches of ``[3, 2, 2]`` (``paddle_pixels``).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
import transformers
from PIL import Image

from hf_prefix_cache.testing.tiny_build import _finalize
from hf_prefix_cache.testing.tiny_models import random_prompt

IMAGE_ID, VIDEO_ID, VISION_START_ID, VISION_END_ID = 120, 121, 122, 123
PINPOINTS = [[32, 32], [32, 64], [64, 32], [64, 64]]

_TEXT: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": None,
}
_CLIP: dict[str, Any] = {
    "model_type": "clip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": 32,
    "patch_size": 8,
}

#: The Qwen2.5-VL / Qwen3-VL-style vision tower's shape; each family adds its depth and its own keys.
_QWEN_TOWER: dict[str, Any] = {
    "hidden_size": 32,
    "out_hidden_size": 64,
    "intermediate_size": 64,
    "num_heads": 4,
    "patch_size": 2,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}
#: The placeholder and framing ids of the Qwen-VL families.
_QWEN_IDS: dict[str, Any] = {
    "image_token_id": IMAGE_ID,
    "video_token_id": VIDEO_ID,
    "vision_start_token_id": VISION_START_ID,
    "vision_end_token_id": VISION_END_ID,
}


def _build(model_cls: type, config: Any) -> Any:
    torch.manual_seed(0)
    config._attn_implementation = "eager"
    return _finalize(model_cls(config))


def tiny_llava() -> Any:
    """LLaVA with a Llama text model: 16 placeholders per 32x32 image."""
    config = transformers.LlavaConfig(
        text_config={**_TEXT, "model_type": "llama"},
        vision_config=_CLIP,
        image_token_index=IMAGE_ID,
        vision_feature_layer=-1,
    )
    return _build(transformers.LlavaForConditionalGeneration, config)


def tiny_llava_next() -> Any:
    """LLaVA-NeXT (anyres) with a Llama text model."""
    config = transformers.LlavaNextConfig(
        text_config={**_TEXT, "model_type": "llama"},
        vision_config=_CLIP,
        image_token_index=IMAGE_ID,
        vision_feature_layer=-1,
        image_grid_pinpoints=PINPOINTS,
    )
    return _build(transformers.LlavaNextForConditionalGeneration, config)


def tiny_llava_next_video() -> Any:
    """LLaVA-NeXT-Video: LLaVA-NeXT images; each 32x32 video frame is 4 placeholders (2x2 pooling)."""
    config = transformers.LlavaNextVideoConfig(
        text_config={**_TEXT, "model_type": "llama"},
        vision_config=_CLIP,
        image_token_index=IMAGE_ID,
        video_token_index=VIDEO_ID,
        vision_feature_layer=-1,
        image_grid_pinpoints=PINPOINTS,
        spatial_pool_stride=2,
    )
    return _build(transformers.LlavaNextVideoForConditionalGeneration, config)


def video_frames(seed: int, frames: int = 2) -> torch.Tensor:
    """One LLaVA-NeXT-Video clip: ``[frames, 3, 32, 32]`` float32."""
    return torch.rand(frames, 3, 32, 32, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def tiny_qwen2_vl() -> Any:
    """Qwen2-VL (M-RoPE, 2x2 merge)."""
    config = transformers.Qwen2VLConfig(
        text_config={
            **_TEXT,
            "model_type": "qwen2_vl_text",
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]},
        },
        vision_config={
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 4,
            "patch_size": 2,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
            "mlp_ratio": 2,
        },
        image_token_id=IMAGE_ID,
        video_token_id=VIDEO_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
    )
    return _build(transformers.Qwen2VLForConditionalGeneration, config)


def tiny_llava_onevision() -> Any:
    """LLaVA-OneVision (anyres, SigLIP tower, Qwen2 text), the config's default `vision_aspect_ratio`."""
    config = transformers.LlavaOnevisionConfig(
        text_config={**_TEXT, "model_type": "qwen2"},
        vision_config={**_CLIP, "model_type": "siglip_vision_model"},
        image_token_index=IMAGE_ID,
        video_token_index=VIDEO_ID,
        vision_feature_layer=-1,
        image_grid_pinpoints=PINPOINTS,
    )
    return _build(transformers.LlavaOnevisionForConditionalGeneration, config)


def tiny_qwen2_5_vl() -> Any:
    """Qwen2.5-VL (M-RoPE, windowed vision attention), same patch layout as Qwen2-VL."""
    config = transformers.Qwen2_5_VLConfig(
        text_config={
            **_TEXT,
            "model_type": "qwen2_5_vl_text",
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]},
        },
        vision_config={
            "depth": 1,
            **_QWEN_TOWER,
            "window_size": 8,
            "fullatt_block_indexes": [0],
        },
        **_QWEN_IDS,
    )
    return _build(transformers.Qwen2_5_VLForConditionalGeneration, config)


_SIGLIP = {**_CLIP, "model_type": "siglip_vision_model"}
BOI_ID, EOI_ID = 124, 125


def tiny_gemma3(config_cls: Any = transformers.Gemma3Config) -> Any:
    """Gemma 3: 4 placeholders per image between begin/end-of-image ids; sliding + full text layers.

    `config_cls` ShieldGemma2Config builds ShieldGemma 2's generator (the same class, its own model type).
    """
    config = config_cls(
        text_config={
            **_TEXT,
            "model_type": "gemma3_text",
            "head_dim": 16,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        vision_config=_SIGLIP,
        mm_tokens_per_image=4,
        image_token_index=IMAGE_ID,
        boi_token_index=BOI_ID,
        eoi_token_index=EOI_ID,
    )
    return _build(transformers.Gemma3ForConditionalGeneration, config)


def tiny_paligemma() -> Any:
    """PaliGemma (prefix-LM): 16 placeholders per image at the start of the prompt."""
    config = transformers.PaliGemmaConfig(
        text_config={**_TEXT, "model_type": "gemma", "head_dim": 16},
        vision_config={**_SIGLIP, "projection_dim": 64},
        image_token_index=IMAGE_ID,
        projection_dim=64,
    )
    return _build(transformers.PaliGemmaForConditionalGeneration, config)


AUDIO_ID = 126
MEL_BINS, MEL_FRAMES = 16, 100


def tiny_qwen2_audio() -> Any:
    """Qwen2-Audio: clips of 100 mel frames (16 bins); a clip of `f` valid frames has `((f-1)//2+1-2)//2+1` placeholders."""
    config = transformers.Qwen2AudioConfig(
        text_config={**_TEXT, "model_type": "qwen2"},
        audio_config={
            "model_type": "qwen2_audio_encoder",
            "d_model": 32,
            "encoder_layers": 2,
            "encoder_attention_heads": 4,
            "encoder_ffn_dim": 64,
            "num_mel_bins": MEL_BINS,
            "max_source_positions": MEL_FRAMES // 2,
        },
        audio_token_index=AUDIO_ID,
    )
    return _build(transformers.Qwen2AudioForConditionalGeneration, config)


def audio_clip(seed: int, frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One clip as the processor pads it: ``[16, 100]`` mel features (zeros past `frames`) and its frame mask."""
    features = torch.zeros(MEL_BINS, MEL_FRAMES)
    features[:, :frames] = torch.rand(MEL_BINS, frames, generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros(MEL_FRAMES, dtype=torch.long)
    mask[:frames] = 1
    return features, mask


def audio_tokens(frames: int) -> int:
    """Placeholders of a clip with `frames` valid mel frames."""
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


def tiny_qwen3_vl() -> Any:
    """Qwen3-VL (interleaved M-RoPE, deepstack features), same patch layout as Qwen2-VL."""
    config = transformers.Qwen3VLConfig(
        text_config={
            **_TEXT,
            "model_type": "qwen3_vl_text",
            "head_dim": 16,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1e4,
                "mrope_section": [2, 3, 3],
                "mrope_interleaved": True,
            },
        },
        vision_config={
            "depth": 2,
            **_QWEN_TOWER,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [0],
        },
        **_QWEN_IDS,
    )
    return _build(transformers.Qwen3VLForConditionalGeneration, config)


#: GLM-4V's video start/end ids: a video's frames are image placeholders between them.
VIDEO_START_ID, VIDEO_END_ID = 110, 111
_MROPE_TEXT = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]}
_GLM_VISION: dict[str, Any] = {"depth": 1, **_QWEN_TOWER, "image_size": 8}
_GLM_IDS = {
    "image_token_id": IMAGE_ID,
    "video_token_id": VIDEO_ID,
    "image_start_token_id": VISION_START_ID,
    "image_end_token_id": VISION_END_ID,
    "video_start_token_id": VIDEO_START_ID,
    "video_end_token_id": VIDEO_END_ID,
}


def _glm(config_name: str, model_name: str, text_type: str, vision_type: str, **text: Any) -> Any:
    """A GLM-4V-family model: Qwen2-VL's patch layout (2x2 merge), frames framed by begin/end-of-image ids."""
    config = getattr(transformers, config_name)(
        text_config={**_TEXT, "model_type": text_type, "rope_parameters": _MROPE_TEXT, **text},
        vision_config={**_GLM_VISION, "model_type": vision_type},
        **_GLM_IDS,
    )
    return _build(getattr(transformers, model_name), config)


def tiny_glm4v() -> Any:
    """GLM-4.1V (M-RoPE): images as Qwen2-VL; video frames are image placeholders inside video start/end ids."""
    return _glm("Glm4vConfig", "Glm4vForConditionalGeneration", "glm4v_text", "glm4v_vision")


def tiny_glm4v_moe() -> Any:
    """GLM-4.5V: GLM-4V with a mixture-of-experts text model (half-rotary heads)."""
    rope = {**_MROPE_TEXT, "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 2]}
    experts = {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1}
    text = {"rope_parameters": rope, **experts}
    return _glm("Glm4vMoeConfig", "Glm4vMoeForConditionalGeneration", "glm4v_moe_text", "glm4v_moe_vision", **text)


def tiny_glm46v() -> Any:
    """GLM-4.6V: GLM-4V's text and vision models under its own config and class."""
    return _glm("Glm46VConfig", "Glm46VForConditionalGeneration", "glm4v_text", "glm4v_vision")


def tiny_glmga() -> Any:
    """GLM-GA: its own config type, built as `Glm46VForConditionalGeneration` (as transformers' auto classes do)."""
    return _glm("GlmgaConfig", "Glm46VForConditionalGeneration", "glm4v_text", "glm4v_vision")


def tiny_glm_ocr() -> Any:
    """GLM-OCR: GLM-4V's layout with its own text and vision models."""
    return _glm("GlmOcrConfig", "GlmOcrForConditionalGeneration", "glm_ocr_text", "glm_ocr_vision")


def tiny_paddleocr_vl() -> Any:
    """PaddleOCR-VL (images only): a SigLIP-style tower over ``[3, 2, 2]`` patches, 2x2 merge, M-RoPE text."""
    config = transformers.PaddleOCRVLConfig(
        text_config={**_TEXT, "model_type": "paddleocr_vl_text", "head_dim": 16, "rope_parameters": _MROPE_TEXT},
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "image_size": 8,
            "patch_size": 2,
            "spatial_merge_size": 2,
        },
        image_token_id=IMAGE_ID,
        video_token_id=VIDEO_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
    )
    return _build(transformers.PaddleOCRVLForConditionalGeneration, config)


FAKE_IMAGE_ID = 124


def _idefics3_config(config_cls: type, vision_type: str) -> Any:
    return config_cls(
        text_config={**_TEXT, "model_type": "llama"},
        vision_config={**_CLIP, "model_type": vision_type},
        scale_factor=2,
        image_token_id=IMAGE_ID,
    )


def tiny_idefics3() -> Any:
    """Idefics3: each 32x32 crop is 4 placeholders (pixel shuffle 2), framed by fake-image ids."""
    return _build(
        transformers.Idefics3ForConditionalGeneration, _idefics3_config(transformers.Idefics3Config, "idefics3_vision")
    )


def tiny_smolvlm() -> Any:
    """SmolVLM: Idefics3's layout."""
    return _build(
        transformers.SmolVLMForConditionalGeneration, _idefics3_config(transformers.SmolVLMConfig, "smolvlm_vision")
    )


def tiny_idefics2() -> Any:
    """Idefics2: each 32x32 crop is 4 placeholders (a perceiver resampler of 4 latents), framed by fake-image ids."""
    perceiver = {
        "hidden_size": 64,
        "resampler_n_latents": 4,
        "resampler_depth": 1,
        "resampler_n_heads": 4,
        "resampler_head_dim": 16,
        "num_key_value_heads": 2,
    }
    config = transformers.Idefics2Config(
        text_config={**_TEXT, "model_type": "mistral"},
        vision_config={**_CLIP, "model_type": "idefics2_vision"},
        perceiver_config=perceiver,
        image_token_id=IMAGE_ID,
    )
    return _build(transformers.Idefics2ForConditionalGeneration, config)


TINY_VLMS = {
    "idefics2": tiny_idefics2,
    "llava_next_video": tiny_llava_next_video,
    "idefics3": tiny_idefics3,
    "smolvlm": tiny_smolvlm,
    "qwen3_vl": tiny_qwen3_vl,
    "glm4v": tiny_glm4v,
    "glm4v_moe": tiny_glm4v_moe,
    "glm46v": tiny_glm46v,
    "glmga": tiny_glmga,
    "glm_ocr": tiny_glm_ocr,
    "paddleocr_vl": tiny_paddleocr_vl,
    "qwen2_audio": tiny_qwen2_audio,
    "gemma3": tiny_gemma3,
    "shieldgemma2": lambda: tiny_gemma3(transformers.ShieldGemma2Config),
    "paligemma": tiny_paligemma,
    "llava": tiny_llava,
    "llava_next": tiny_llava_next,
    "qwen2_vl": tiny_qwen2_vl,
    "llava_onevision": tiny_llava_onevision,
    "qwen2_5_vl": tiny_qwen2_5_vl,
}


@functools.cache
def cached_vlm(name: str) -> Any:
    """One instance per name per session."""
    return TINY_VLMS[name]()


def pil_image(seed: int, height: int = 32, width: int = 32) -> Image.Image:
    """A random RGB image."""
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8))


def llava_pixels(seed: int) -> torch.Tensor:
    """One LLaVA image as the model consumes it: ``[3, 32, 32]`` float32."""
    return torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@functools.cache
def llava_next_processor() -> Any:
    """The real LLaVA-NeXT image processor (PIL backend), configured for the tiny tower."""
    return transformers.LlavaNextImageProcessorPil(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, image_grid_pinpoints=PINPOINTS
    )


def llava_next_tokens(model: Any, pixel_values: torch.Tensor, image_sizes: torch.Tensor) -> list[int]:
    """Placeholder count of each image, as the model's feature packing produces them."""
    with torch.no_grad():
        features = model.model.get_image_features(pixel_values, image_sizes).pooler_output
    return [int(f.shape[0]) for f in features]


def qwen_pixels(seed: int, grid: tuple[int, int, int] = (1, 4, 6)) -> tuple[torch.Tensor, torch.Tensor]:
    """One Qwen2-VL item: ``t*h*w`` patch rows and its ``[1, 3]`` grid."""
    t, h, w = grid
    rows = torch.rand(t * h * w, 3 * 2 * 2 * 2, generator=torch.Generator().manual_seed(seed))
    return rows, torch.tensor([list(grid)])


def paddle_pixels(seed: int, grid: tuple[int, int, int] = (1, 4, 6)) -> tuple[torch.Tensor, torch.Tensor]:
    """One PaddleOCR-VL image: ``t*h*w`` patches of ``[3, 2, 2]`` and its ``[1, 3]`` grid."""
    t, h, w = grid
    rows = torch.rand(t * h * w, 3, 2, 2, generator=torch.Generator().manual_seed(seed))
    return rows, torch.tensor([list(grid)])


def glm_video_tokens(grid: torch.Tensor, first_second: int = 0) -> torch.Tensor:
    """A GLM-4V video's ids as its processor writes them: per frame, begin-of-image, the frame's
    ``h*w/4`` image placeholders, end-of-image and its timestamp (one text id), all between the
    video start and end ids."""
    t, h, w = (int(x) for x in grid.reshape(-1))
    parts = [run(VIDEO_START_ID, 1)]
    for frame in range(t):
        stamp = torch.tensor([[4 + (first_second + frame) % 96]])
        parts += [run(VISION_START_ID, 1), run(IMAGE_ID, h * w // 4), run(VISION_END_ID, 1), stamp]
    return torch.cat([*parts, run(VIDEO_END_ID, 1)], dim=1)


def glm_marks(ids: torch.Tensor) -> torch.Tensor:
    """The GLM-4V processor's ``mm_token_type_ids``: image placeholders are 2 inside a video, else 1."""
    video = (ids == VIDEO_START_ID).cumsum(-1) > (ids == VIDEO_END_ID).cumsum(-1)
    placeholders = ids == IMAGE_ID
    return (placeholders & ~video).int() + 2 * (placeholders & video).int()


def text(n: int, seed: int) -> torch.Tensor:
    """``n`` random text ids."""
    return random_prompt(n, seed=seed)


def run(token_id: int, n: int) -> torch.Tensor:
    """``n`` placeholders."""
    return torch.full((1, n), token_id, dtype=torch.long)


# --------------------------------------------------------------------------- processors, built offline

_CORPUS = [
    "the cat sat on the mat",
    "describe this picture please",
    "what is in the image",
    "a red square and a blue circle",
    "tell me more about the colours",
    "and now compare both pictures",
]
#: Chat markers, after the media ids 120-123.
CHAT_TOKENS = ["<|user|>", "<|assistant|>", "<|end|>"]


def tiny_tokenizer(media_tokens: list[str]) -> Any:
    """A byte-level BPE trained here on a toy corpus, padded to 120 ids, then `media_tokens` and chat markers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=100, special_tokens=["<pad>", "<s>", "</s>", "<unk>"], show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer)
    tok.add_special_tokens([f"<extra_{i}>" for i in range(IMAGE_ID - tok.get_vocab_size())])
    tok.add_special_tokens([*media_tokens, *CHAT_TOKENS])
    assert tok.token_to_id(media_tokens[0]) == IMAGE_ID, tok.token_to_id(media_tokens[0])
    return transformers.PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def _template(image: str) -> str:
    return (
        "{% for m in messages %}<|{{ m.role }}|>{% if m.content is string %}{{ m.content }}{% else %}"
        "{% for c in m.content %}{% if c.type == 'image' %}" + image + "{% else %}{{ c.text }}{% endif %}{% endfor %}"
        "{% endif %}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )


@functools.cache
def llava_processor() -> Any:
    """A real `LlavaProcessor`: PIL CLIP-style image processor (32x32) and the tiny tokenizer."""
    image_processor = transformers.LlavaImageProcessorPil(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    )
    return transformers.LlavaProcessor(  # type: ignore[no-untyped-call]
        image_processor=image_processor,
        tokenizer=tiny_tokenizer(["<image>"]),
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token="<image>",
        chat_template=_template("<image>"),
    )


class _ImageOnlyQwen2VLProcessor(transformers.Qwen2VLProcessor):
    """`Qwen2VLProcessor` without its video processor, which needs torchvision (not installed here)."""

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs: Any):
        from transformers.processing_utils import ProcessorMixin

        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)  # type: ignore[no-untyped-call]


@functools.cache
def qwen2_vl_processor() -> Any:
    """The real Qwen2-VL image processor (PIL backend, 2x2 patches, 2x2 merge) and processor logic."""
    image_processor = transformers.Qwen2VLImageProcessorPil(
        patch_size=2, merge_size=2, temporal_patch_size=2, min_pixels=8 * 8, max_pixels=16 * 16
    )
    return _ImageOnlyQwen2VLProcessor(
        image_processor=image_processor,
        tokenizer=tiny_tokenizer(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]),
        chat_template=_template("<|vision_start|><|image_pad|><|vision_end|>"),
    )
