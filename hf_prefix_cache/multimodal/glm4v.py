"""The GLM-4V family (GLM-4.1V, GLM-4.5V, GLM-4.6V, GLM-GA, GLM-OCR) and PaddleOCR-VL, on the Qwen-VL adapters.

Their `get_rope_index` and vision inputs follow Qwen2-VL's layout (flattened patch rows per
item from `*_grid_thw`, positions over the whole prompt from all grids), so the Qwen-VL
adapters serve them with a few differences:

* GLM-4V writes a video as Qwen3-VL does (one placeholder run per frame, its timestamp text
  between runs), but its frames use the **image** placeholder id: what makes a run a video
  frame is that it lies between `video_start_token_id` and `video_end_token_id`, which is
  how the processor's `mm_token_type_ids` marks it (2) and how `get_rope_index` reads it.
* Its `forward` scatters image and video features into the same placeholder mask, so a call
  passing both fails in transformers; such prompts run cold (`images_and_videos`) so the
  store never answers where the model itself raises.
* PaddleOCR-VL has images only.

In transformers 5.23 the GLM classes share `get_rope_index`, `get_placeholder_mask` and
`forward` (GLM-4.5V adds experts; GLM-GA builds `Glm46VForConditionalGeneration`). Their own
path after a restored prefix adds `rope_deltas` left on the model by the last request: 2e-3 to
1.5e-2 off on tiny models when that request was another one, hence the explicit positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hf_prefix_cache import reasons
from hf_prefix_cache.multimodal.base import config_token_id
from hf_prefix_cache.multimodal.media import find_runs
from hf_prefix_cache.multimodal.qwen_vl import Qwen2VLMedia, Qwen3VLMedia
from hf_prefix_cache.multimodal.registry import MediaFamily, register


class Glm4vMedia(Qwen3VLMedia):
    """GLM-4V: images as Qwen2-VL; a video's frames are image placeholders inside the video's start/end ids."""

    _KINDS = (
        ("image", "image_token_id", "pixel_values", "image_grid_thw"),
        ("video", "image_token_id", "pixel_values_videos", "video_grid_thw"),
    )
    _CODES = {"image": 1, "video": 2}

    def token_marks(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The processor's `mm_token_type_ids`: 2 on image placeholders inside a video, 1 on the others."""
        marks = torch.zeros_like(input_ids, dtype=torch.int)
        image_id = config_token_id(self.config, "image_token_id")
        if image_id is None:
            return marks
        placeholders = input_ids == image_id
        start, end = (config_token_id(self.config, name) for name in ("video_start_token_id", "video_end_token_id"))
        video = torch.zeros_like(placeholders)
        if start is not None and end is not None:
            # As the processor: inside a video once more starts than ends have been seen.
            video = (input_ids == start).cumsum(-1) > (input_ids == end).cumsum(-1)
        marks[placeholders & ~video] = self._CODES["image"]
        marks[placeholders & video] = self._CODES["video"]
        return marks

    def _runs(self, tokens: Sequence[int], kind: str, token_id: int) -> list[tuple[int, int]]:
        # A run never crosses a video start/end id, so its first token's mark is the whole run's.
        marks = self.token_marks(torch.tensor([list(tokens)], dtype=torch.long))[0].tolist()
        return [(a, b) for a, b in find_runs(tokens, token_id) if marks[a] == self._CODES[kind]]

    def why_cold(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> str | None:
        reason = super().why_cold(tokens, kwargs)
        if reason is None and kwargs.get("pixel_values") is not None and kwargs.get("pixel_values_videos") is not None:
            # Both fill every image placeholder in transformers 5.23, so the cold run raises; never answer instead.
            return reasons.IMAGES_AND_VIDEOS
        return reason


class PaddleOcrVlMedia(Qwen2VLMedia):
    """PaddleOCR-VL: Qwen2-VL's image items and positions; no videos."""

    handled = frozenset({"pixel_values", "image_grid_thw", "mm_token_type_ids"})
    marks = ((("image_token_id",), 1),)
    _KINDS = (("image", "image_token_id", "pixel_values", "image_grid_thw"),)


register(MediaFamily(("glm4v", "glm4v_moe", "glm46v", "glmga", "glm_ocr"), Glm4vMedia))
register(MediaFamily(("paddleocr_vl",), PaddleOcrVlMedia))
