"""Ernie 4.5 VL (MoE): Qwen2-VL's items and explicit positions, with its temporal merge and modality experts.

Its vision tower (attention within each frame) and resampler (a 2x2 spatial merge, then a
video's frames merged in pairs, an image's one frame doubled) work within each item, on
Qwen2-VL's flattened patch rows; a video is one run of ``t*h*w / (4 * temporal_merge_size)``
placeholders. Its `get_rope_index` reads the processor's `mm_token_type_ids` as Qwen2-VL's does;
its own path after a restored prefix adds `rope_deltas` left on the model, hence the explicit
positions. Its MoE layers send each token to the text or the vision experts by a second mark,
`moe_mm_token_type_ids` (the processor's: image placeholders and the image start/end ids 1,
video ones 2), which changes the states of those tokens: a call whose marks are not exactly the
processor's for its ids (or that leaves them out where they would mark a token) runs cold.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hf_prefix_cache import reasons
from hf_prefix_cache.multimodal.base import config_token_id
from hf_prefix_cache.multimodal.qwen_vl import Qwen2VLMedia
from hf_prefix_cache.multimodal.registry import MediaFamily, register

#: The processor's expert marks: the config names of the ids each code marks.
_EXPERT_MARKS = (
    (("image_token_id", "image_start_token_id", "image_end_token_id"), 1),
    (("video_token_id", "video_start_token_id", "video_end_token_id"), 2),
)
_EXPERTS = "moe_mm_token_type_ids"


class Ernie4_5VLMedia(Qwen2VLMedia):
    """Ernie 4.5 VL: Qwen2-VL's items (a video's placeholders also divided by the temporal merge) and positions."""

    handled = Qwen2VLMedia.handled | {_EXPERTS}

    def _temporal_merge(self) -> int:
        return int(self.config.vision_config.temporal_merge_size)

    def _item_len(self, kind: str, grid: list[int], merged: int) -> int | None:
        if kind != "video":
            return merged
        merge = self._temporal_merge()
        # The resampler merges a video's frames in pairs; the processor never sends an odd count.
        return merged // merge if grid[0] % merge == 0 else None

    def expert_marks(self, input_ids: torch.Tensor) -> torch.Tensor:
        """What the processor puts in `moe_mm_token_type_ids` for `input_ids`."""
        marks = torch.zeros_like(input_ids, dtype=torch.int)
        for names, code in _EXPERT_MARKS:
            for name in names:
                token_id = config_token_id(self.config, name)
                if token_id is not None:
                    marks[input_ids == token_id] = code
        return marks

    def why_cold(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> str | None:
        reason = super().why_cold(tokens, kwargs)
        if reason is not None:
            return reason
        # The expert marks route tokens whatever else the call passes: they must be the processor's.
        expected = self.expert_marks(torch.tensor([list(tokens)], dtype=torch.long))
        marks = kwargs.get(_EXPERTS)
        if marks is None:
            return reasons.marks_missing(_EXPERTS) if bool(expected.any()) else None
        if not isinstance(marks, torch.Tensor) or not torch.equal(marks.detach().cpu().to(torch.int), expected):
            return reasons.marks_differ(_EXPERTS)
        return None


register(MediaFamily(("ernie4_5_vl_moe",), Ernie4_5VLMedia, kwargs=(_EXPERTS,)))
