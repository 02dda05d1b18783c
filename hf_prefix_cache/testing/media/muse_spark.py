"""A tiny Muse Spark and its media (images and videos as flattened patch grids, raw audio clips), for its tests
and the sweep.

Its vision tower is Muse Glimmer's (windows and attention within each item, a 2x2 pixel shuffle) on rows
of ``2 * 3 * 4 * 4`` values (2 frames of 4x4 pixels), ``t * h * w / 4`` placeholders per item; its audio
tower is causal convolutions only, one placeholder per started 8 samples (`patch_sizes` 4 and 2) of a
clip's valid part. Clips are padded to 48 samples with their `input_values_mask`, as its feature
extractor pads a prompt's clips to one length. An image or video is ``110 [placeholders] 111``, a clip
``112 [placeholders] 113``. Pool seeds 1 and 13 give one layout, other content; seed 2 another layout.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.media.arrays import padded, seeded_rand
from hf_prefix_cache.testing.media.grid import MUSE_GLIMMER_VISION
from hf_prefix_cache.testing.media.pool import PoolMedium, partial
from hf_prefix_cache.testing.media.thw import grid_kwargs
from hf_prefix_cache.testing.tiny_vlm_parts import _MEDIA_IDS, _TEXT, vlm

IMG, VID, AUD = 120, 121, 126
OPEN, CLOSE, AUDIO_OPEN, AUDIO_CLOSE = 110, 111, 112, 113
GRIDS = [(1, 4, 6), (1, 4, 6), (1, 2, 4)]
VIDEO_GRIDS = [(2, 2, 4), (2, 2, 4), (4, 2, 2)]
#: Per pool seed: a clip's valid samples (of `PADDED`), 5 or 3 placeholders.
SAMPLES, PADDED, HOP = [40, 40, 24], 48, 8
ROW = 2 * 3 * 4 * 4


@functools.cache
def tiny_muse_spark() -> Any:
    """Muse Spark: Muse Glimmer's windowed tower on 2-frame 4x4-pixel patch rows, a causal-conv audio tower
    (8 samples per placeholder); text [sliding, full] with NoPE full layers and an expert MLP."""
    vision = {**MUSE_GLIMMER_VISION, "layer_types": ["window_attention", "full_attention"]}
    text = {
        **_TEXT,
        "model_type": "muse_spark_text",
        "head_dim": 16,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "layer_rope_theta": [500000.0, 0],
        "mlp_layer_types": ["dense", "sparse"],
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "moe_hidden_size": 32,
    }
    audio = {"patch_sizes": [4, 2], "hidden_sizes": [16, 32], "depths": [1, 1], "num_hidden_layers": 2}
    return vlm(
        "MuseSpark",
        text_config=text,
        vision_config=vision,
        audio_config={**audio, "out_hidden_size": _TEXT["hidden_size"]},
        **_MEDIA_IDS,
        audio_token_id=AUD,
        out_hidden_size=128,
        projector_hidden_size=64,
    )


class Medium(PoolMedium):
    """One image, video or clip: its kind and seed."""

    @property
    def grid(self) -> tuple[int, int, int]:
        return (GRIDS if self.kind == "image" else VIDEO_GRIDS)[self.seed % 3]

    @property
    def count(self) -> int:
        """Its placeholders."""
        if self.kind == "audio":
            return -(-SAMPLES[self.seed % 3] // HOP)
        t, h, w = self.grid
        return t * h * w // 4


image, video, clip = partial(Medium, "image"), partial(Medium, "video"), partial(Medium, "audio")


def placeholders(medium: Medium) -> torch.Tensor:
    if medium.kind == "audio":
        return torch.tensor([[AUDIO_OPEN, *[AUD] * medium.count, AUDIO_CLOSE]])
    return torch.tensor([[OPEN, *[IMG if medium.kind == "image" else VID] * medium.count, CLOSE]])


def _rows(medium: Medium) -> torch.Tensor:
    t, h, w = medium.grid
    return seeded_rand(t * h * w, ROW, seed=medium.seed)


def media_kwargs(media: list[Medium]) -> dict[str, Any]:
    """What the processor hands `generate` for `media` in prompt order."""
    out = grid_kwargs(media, _rows)
    clips = [m for m in media if m.kind == "audio"]
    if clips:
        rows = [seeded_rand(SAMPLES[m.seed % 3], seed=m.seed) * 2 - 1 for m in clips]
        out["input_values"], out["input_values_mask"] = padded(rows, PADDED, torch.int32)
    return out


registry.register_mixed(
    "muse_spark",
    tiny_muse_spark,
    placeholders,
    media_kwargs,
    {"image": image, "video": video, "audio": clip},
    ("image", "audio", "video"),
)
