"""A tiny LLaVA-OneVision with its real image processor and processor, and its images in one mode.

The model uses `vision_aspect_ratio="anyres_max_1"`, so large images take its feature-shrinking
path. `OneVision` gives a mode's images (`tiled`: a flat image list; `single`: a nested one), their
processor output and placeholders, counted from the model's own features.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import transformers

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.testing.compare import assert_same_as_cold
from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.tiny_processors import tiny_tokenizer
from hf_prefix_cache.testing.tiny_vlm_media import pil_image, run
from hf_prefix_cache.testing.tiny_vlm_parts import (
    _MEDIA_INDEX,
    _SIGLIP,
    IMAGE_ID,
    PINPOINTS,
    VIDEO_ID,
    text_config,
    vlm,
)

NEW = 5
SPECIAL_IDS = list(range(100, 128))
#: Sizes (height, width) covering every pinpoint, unpadding both ways and the shrink of a 64x64 grid.
SIZES = [(30, 60), (50, 40), (32, 32), (64, 20), (64, 64), (20, 90)]


@functools.cache
def tiny_onevision() -> Any:
    """LLaVA-OneVision (SigLIP tower, Qwen2 text) whose anyres feature maps shrink above one patch's worth."""
    return vlm(
        "LlavaOnevision",
        text_config=text_config("qwen2"),
        vision_config=_SIGLIP,
        **_MEDIA_INDEX,
        vision_feature_layer=-1,
        image_grid_pinpoints=PINPOINTS,
        vision_aspect_ratio="anyres_max_1",
    )


@functools.cache
def onevision_image_processor() -> Any:
    """The real OneVision image processor (PIL backend) for the tiny tower."""
    return transformers.LlavaOnevisionImageProcessorPil(
        size={"height": 32, "width": 32}, image_grid_pinpoints=PINPOINTS
    )


class _ImageOnlyOnevisionProcessor(transformers.LlavaOnevisionProcessor):
    """`LlavaOnevisionProcessor` without its video processor, which needs torchvision (not installed here)."""

    def __init__(self, image_processor: Any, tokenizer: Any, chat_template: str) -> None:
        from transformers.processing_utils import ProcessorMixin

        self.num_image_tokens, self.vision_feature_select_strategy = 16, "full"
        self.image_token, self.video_token = "<image>", "<video>"
        self.image_token_id, self.video_token_id = IMAGE_ID, VIDEO_ID
        self.vision_aspect_ratio = "anyres_max_1"
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)  # type: ignore[no-untyped-call]


@functools.cache
def onevision_processor() -> Any:
    """A real `LlavaOnevisionProcessor` (placeholder expansion, chat template) for the tiny model."""
    template = (
        "{% for m in messages %}<|{{ m.role }}|>{% if m.content is string %}{{ m.content }}{% else %}"
        "{% for c in m.content %}{% if c.type == 'image' %}<image>{% else %}{{ c.text }}{% endif %}{% endfor %}"
        "{% endif %}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return _ImageOnlyOnevisionProcessor(onevision_image_processor(), tiny_tokenizer(["<image>", "<video>"]), template)


class OneVision:
    """Images of the tiny OneVision model in one mode: `tiled` (a flat image list) or `single` (a nested one)."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.model = tiny_onevision()

    def image(self, seed: int) -> Any:
        """A random picture of one of `SIZES`, chosen by `seed`."""
        return pil_image(seed, *SIZES[seed % len(SIZES)])

    def kwargs(self, images: list[Any]) -> dict[str, Any]:
        """The image processor's output for `images` in this mode."""
        batch = [images] if self.mode == "single" else images
        return dict(onevision_image_processor()(batch, return_tensors="pt"))

    def placeholders(self, images: list[Any], index: int) -> torch.Tensor:
        """The placeholders of `images[index]` in a prompt holding `images`."""
        kw = self.kwargs(images)
        with torch.no_grad():
            features = self.model.model.get_image_features(
                kw["pixel_values"], kw["image_sizes"], batch_num_images=kw["batch_num_images"]
            ).pooler_output
        return run(IMAGE_ID, int(features[index].shape[0]))

    def check(self, ids: torch.Tensor, images: list[Any], store: PrefixCache, **extra: Any) -> Any:
        """Run `ids` with `images` cold and through `store`; assert both agree (returns the cached output)."""
        kwargs = {**self.kwargs(images), **extra, "suppress_tokens": SPECIAL_IDS}
        return assert_same_as_cold(self.model, ids, store, new=NEW, **kwargs)

    def num_patches(self, images: list[Any]) -> int:
        """Patches the tower encodes for `images` alone (in this mode)."""
        if self.mode == "single":
            return len(images)
        kw = self.kwargs(images)
        adapter: Any = media_adapter_for(self.model)
        return sum(adapter._num_patches(kw["image_sizes"], kw))


def _sweep() -> registry.SweepCase:
    """LLaVA-OneVision (anyres, images as a flat list) in the support matrix's scenario."""
    fam = OneVision("tiled")
    media = registry.three(fam.image)
    tokens = {k: fam.placeholders([m], 0) for k, m in media.items()}
    return registry.SweepCase(fam.model, tokens, lambda _ids, names: fam.kwargs([media[n] for n in names]))


registry.register_sweep("llava_onevision", _sweep)
