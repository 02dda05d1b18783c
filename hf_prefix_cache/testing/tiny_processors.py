"""Real processors of the tiny VLMs, built offline: a toy byte-level BPE tokenizer and PIL image processors.

The tokenizer is trained here on a toy corpus; its media ids start at `tiny_vlm_parts.IMAGE_ID`
(120), after which come the chat markers.
"""

from __future__ import annotations

import functools
from typing import Any

import transformers

from hf_prefix_cache.testing.tiny_vlm_parts import IMAGE_ID, PINPOINTS

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
def llava_next_processor() -> Any:
    """The real LLaVA-NeXT image processor (PIL backend), configured for the tiny tower."""
    return transformers.LlavaNextImageProcessorPil(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, image_grid_pinpoints=PINPOINTS
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


class _TextOnlyQwen3VLProcessor(transformers.Qwen3VLProcessor):
    """`Qwen3VLProcessor`'s text path (placeholder expansion) alone: its video processor needs torchvision
    (not installed here), so its two sizes stand in for it. The release's own `replace_video_token` and
    `get_text_with_replacements` write the prompt (5.25 collapses the template's outer video wrapper)."""

    def __init__(self, tokenizer: Any) -> None:
        from types import SimpleNamespace

        self.tokenizer = tokenizer
        self.image_processor = self.video_processor = SimpleNamespace(merge_size=2, temporal_patch_size=2)
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.vision_start_token, self.vision_end_token = "<|vision_start|>", "<|vision_end|>"
        for name in ("image", "video", "vision_start", "vision_end"):
            setattr(self, f"{name}_token_id", tokenizer.convert_tokens_to_ids(getattr(self, f"{name}_token")))


@functools.cache
def qwen3_vl_text_processor() -> Any:
    """A Qwen3-VL processor for prompts (ids 120-123: image, video, vision start, vision end), not pixels."""
    return _TextOnlyQwen3VLProcessor(
        tiny_tokenizer(["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])
    )
