"""Ovis2.5: Qwen-VL-style flattened patch rows per item, each item framed by its kind's start and end ids.

The processor writes an image as ``image_start``, ``grid.prod() / merge**2`` image placeholders and
``image_end`` (a video likewise with its own ids). In a call passing a kind's pixels the model embeds
every start and end id of that kind from its visual table (and checks there is one pair per item);
without them, as text. So each item spans its framing ids as well as its placeholders: a cut never
separates them, and a suffix holds the framing ids of its own items only, whose pixels it gets.
The tower encodes each item on its own (windows and attention within it); positions are 1D.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from hf_prefix_cache.multimodal.base import config_token_id
from hf_prefix_cache.multimodal.generic import GenericMedia
from hf_prefix_cache.multimodal.generic_rules import IMAGE_TOKEN_ID, VIDEO_TOKEN_ID, FamilyRule, KindRule
from hf_prefix_cache.multimodal.media import MediaLayout
from hf_prefix_cache.multimodal.registry import MediaFamily, register

_MERGE = ("vision_config.spatial_merge_size", "vision_config.spatial_merge_size")
RULE = FamilyRule(
    kinds=(
        KindRule("image", IMAGE_TOKEN_ID, "pixel_values", count="thw", sizes="image_grid_thw", stride=_MERGE),
        KindRule("video", VIDEO_TOKEN_ID, "pixel_values_videos", count="thw", sizes="video_grid_thw", stride=_MERGE),
    ),
)
#: Per kind: the config names of the ids framing each of its items.
FRAMES = {
    "image": ("image_start_token_id", "image_end_token_id"),
    "video": ("video_start_token_id", "video_end_token_id"),
}


class Ovis2_5Media(GenericMedia):
    """Ovis2.5: the generic ``"thw"`` layout, each item widened to the start and end ids around its placeholders."""

    def __init__(self, model: Any) -> None:
        super().__init__(model, RULE)

    def layout(self, tokens: Sequence[int], kwargs: dict[str, Any]) -> MediaLayout | None:
        placed = super().layout(tokens, kwargs)
        if placed is None:
            return None
        items = []
        for item in placed.items:
            start_id, end_id = (config_token_id(self.config, name) for name in FRAMES[item.kind])
            framed = item.start > 0 and item.end < len(tokens)
            if not framed or tokens[item.start - 1] != start_id or tokens[item.end] != end_id:
                return None  # placeholders without their frame: the model would not embed it as the processor writes it
            items.append(dataclasses.replace(item, start=item.start - 1, end=item.end + 1))
        for rule in RULE.kinds:
            if kwargs.get(rule.data) is None:
                continue  # this kind's framing ids are text in every call, cached or cold
            ids = [config_token_id(self.config, name) for name in FRAMES[rule.kind]]
            count = sum(item.kind == rule.kind for item in items)
            if any(sum(t == i for t in tokens) != count for i in ids):
                return None  # framing ids outside the kind's items: a suffix could hold them without their pixels
        return MediaLayout(tuple(items))


register(MediaFamily(("ovis2_5",), Ovis2_5Media))
