"""A tiny Granite 4 Vision and its images (LLaVA-NeXT anyres tiles), for its media tests and the sweep.

Its CLIP tower reads 32x32 tiles (8x8 patches, 4x4 per tile); every Window Q-Former projector halves
a tile's side (``downsample_rate`` 1/2: 2x2 features per tile), one DeepStack projector feeds the
first text layer and one spatial projector the second. An image is its base tile and its anyres
grid (pinpoints up to 64x64), one placeholder run (120) whose length the model's own packing gives
(`num_tokens`). Pool seeds 1 and 13 give a 30x60 image (base tile plus a 1x2 grid), other pixels;
seed 2 a 50x40 image (base tile plus a 2x2 grid).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.media.cases import single
from hf_prefix_cache.testing.tiny_vlm_parts import _CLIP, _TEXT, PINPOINTS, vlm

IMG = 120
#: Image sizes (height, width) per pool seed (seeds 1 and 13 alike).
SIZES = [(64, 20), (30, 60), (50, 40)]


@functools.cache
def tiny_granite4_vision() -> Any:
    """Granite 4 Vision: a CLIP tower (width 64: one Q-Former head), Window Q-Former projectors at rate 1/2."""
    return vlm(
        "Granite4Vision",
        text_config=_TEXT,
        vision_config={**_CLIP, "hidden_size": 64},
        qformer_config={"intermediate_size": 64},
        image_token_index=IMG,
        image_grid_pinpoints=PINPOINTS,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        downsample_rate="1/2",
        deepstack_layer_map=[[-1, 0]],
        spatial_target_layers=[1],
    )


@dataclass(frozen=True)
class Image:
    """An image of pool seed `seed`: its anyres tiles ``[tiles, 3, 32, 32]`` and its size."""

    seed: int

    @property
    def size(self) -> torch.Tensor:
        return torch.tensor(SIZES[self.seed % 3])

    def tiles(self) -> torch.Tensor:
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        count = image_size_to_num_patches(image_size=self.size, grid_pinpoints=PINPOINTS, patch_size=32)
        return torch.rand(count, 3, 32, 32, generator=torch.Generator().manual_seed(self.seed)) * 2 - 1


@functools.cache
def num_tokens(seed: int) -> int:
    """Placeholders of pool image `seed`: the features the model's own packing gives it."""
    image = Image(seed)
    with torch.no_grad():
        features = tiny_granite4_vision().model.get_image_features(image.tiles()[None], image.size[None])
    return int(features.deepstack_features[0][1][0].shape[0])


def placeholders(image: Image) -> torch.Tensor:
    return torch.full((1, num_tokens(image.seed)), IMG, dtype=torch.long)


def media_kwargs(images: list[Image]) -> dict[str, Any]:
    """What the processor hands `generate`: each image's tiles, padded to the prompt's most, and its size."""
    if not images:
        return {}
    most = max(i.tiles().shape[0] for i in images)
    pixels = torch.zeros(len(images), most, 3, 32, 32)
    for row, image in enumerate(images):
        tiles = image.tiles()
        pixels[row, : tiles.shape[0]] = tiles
    return {"pixel_values": pixels, "image_sizes": torch.stack([i.size for i in images])}


def _sweep() -> registry.SweepCase:
    """Granite 4 Vision in the support matrix's scenario: A a 30x60 image, C a 50x40 one."""
    media = registry.three(Image)
    tokens = {k: placeholders(m) for k, m in media.items()}
    return registry.SweepCase(
        tiny_granite4_vision(), tokens, lambda _ids, names: media_kwargs([media[n] for n in names])
    )


registry.register_sweep("granite4_vision", _sweep)
registry.register_suite(
    "granite4_vision",
    lambda: single("granite4_vision", tiny_granite4_vision(), "image", Image, placeholders, media_kwargs, framing=0),
)
