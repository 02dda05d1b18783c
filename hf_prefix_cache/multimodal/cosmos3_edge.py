"""Cosmos 3 Edge: Qwen3-VL's items (a video spans its frames' runs and the timestamps between them), three rotary rows.

Its SigLIP 2 tower embeds each image or frame with positions resized to its own grid and attends
within each (`cu_seqlens`); the projector merges 2x2 patches within an item. Its processor writes
a video as Qwen3-VL's does (one placeholder run per frame, a timestamp between runs) and its
`get_rope_index` reads the processor's `mm_token_type_ids` as Qwen2-VL's does, but its text model
takes the three rotary rows alone (the cold run passes no text row in front), so the positions
passed are those three, of the whole prompt, never derived from `rope_deltas` left on the model.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_prefix_cache.multimodal.qwen_vl import Qwen3VLMedia
from hf_prefix_cache.multimodal.registry import MediaFamily, register


class Cosmos3EdgeMedia(Qwen3VLMedia):
    """Cosmos 3 Edge: Qwen3-VL's items; positions as its `_prepare_position_ids_for_generation` gives them."""

    def positions(self, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        """Explicit `[3, 1, L]` rotary positions of the whole prompt (Qwen3-VL's without their text row)."""
        return super().positions(input_ids, kwargs)[1:]


register(MediaFamily(("cosmos3_edge",), Cosmos3EdgeMedia))
