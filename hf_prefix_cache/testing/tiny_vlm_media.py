"""The tiny VLMs' media and prompt pieces: pixels, clips, frames and images, placeholder runs, text ids.

Each medium is drawn from a seeded generator, shaped as the model (or its processor) consumes
it; the pieces of a prompt are ``[1, n]`` id tensors to concatenate, and what a processor would
add to them (placeholder counts, GLM-4V's token marks) is computed as it does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from PIL import Image

from hf_prefix_cache.testing.tiny_models import random_prompt
from hf_prefix_cache.testing.tiny_vlm_parts import (
    IMAGE_ID,
    MEL_BINS,
    MEL_FRAMES,
    VIDEO_END_ID,
    VIDEO_START_ID,
    VISION_END_ID,
    VISION_START_ID,
)


def video_frames(seed: int, frames: int = 2) -> torch.Tensor:
    """One LLaVA-NeXT-Video clip: ``[frames, 3, 32, 32]`` float32."""
    return torch.rand(frames, 3, 32, 32, generator=torch.Generator().manual_seed(seed)) * 2 - 1


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


def pil_image(seed: int, height: int = 32, width: int = 32) -> Image.Image:
    """A random RGB image."""
    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8))


def llava_pixels(seed: int) -> torch.Tensor:
    """One LLaVA image as the model consumes it: ``[3, 32, 32]`` float32."""
    return torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(seed)) * 2 - 1


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
