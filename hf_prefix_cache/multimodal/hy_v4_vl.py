"""HY V4 VL: Qwen2-VL's flattened patch rows and positions, each merged row of an item ending in a newline feature.

Its vision tower embeds each image or video with positions of its own grid, attends within each
(`cu_seqlens`) and merges each on its own, appending a newline feature to every merged row: an item
of grid ``(t, h, w)`` is one run of ``t * (h/m) * (w/m + 1)`` placeholders (``m`` the spatial
merge; a video's frames one run). Its `get_rope_index` reads the processor's `mm_token_type_ids`
as Qwen2-VL's does, and its cold run passes a text row in front of the three rotary rows, as
Qwen2-VL's adapter does; its own path after a restored prefix adds `rope_deltas` left on the model.
"""

from __future__ import annotations

from hf_prefix_cache.multimodal.qwen_vl import Qwen2VLMedia
from hf_prefix_cache.multimodal.registry import MediaFamily, register


class HYV4VLMedia(Qwen2VLMedia):
    """HY V4 VL: Qwen2-VL's items, each ``t * (h/m) * (w/m + 1)`` placeholders (a newline per merged row)."""

    def _item_len(self, kind: str, grid: list[int], merged: int) -> int | None:
        windows = self._merged_grid(grid)  # None: the merger takes whole merge windows
        return None if windows is None else windows[0] * windows[1] * (windows[2] + 1)


register(MediaFamily(("hy_v4_vl",), HYV4VLMedia))
