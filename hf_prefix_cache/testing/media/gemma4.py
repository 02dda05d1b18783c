"""Tiny Gemma 4 and Gemma 4 Unified models and their media, as the Gemma 4 media tests and the sweep build them.

Both take images and video frames as rows of flattened patches with `(x, y)` positions
(``(-1, -1)`` padding, every row padded to `MAX_PATCHES` as the processor pads to its
`max_soft_tokens`), and audio clips as feature rows with a validity mask. Gemma 4 pools
``2 x 2`` patches per placeholder and subsamples audio frames by 4; Gemma 4 Unified has one
placeholder per patch and per audio frame. Framing ids: begin/end of image 110/111 (frames
too, each after its timestamp text), of audio 112/113; placeholders: image 120, video 121,
audio 126. Pool seeds 1 and 13 give one layout with other content.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.tiny_vlm_parts import _TEXT, _TOWER, vlm

IMG, VID, AUD = 120, 121, 126
BOI, EOI, BOA, EOA = 110, 111, 112, 113
PATCH, KERNEL, MAX_PATCHES = 4, 2, 16
#: Gemma 4's audio tower: two stride-2 subsamplings; its mel rows have `MEL` bins.
MEL, CLIP_ROWS = 16, 48
FAMILIES = ("gemma4", "gemma4_unified")

_GEMMA4_TEXT: dict[str, Any] = {
    **_TEXT,
    "head_dim": 16,
    "global_head_dim": 16,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"],
    "use_bidirectional_attention": "vision",
}
_IDS: dict[str, Any] = {
    "image_token_id": IMG,
    "video_token_id": VID,
    "audio_token_id": AUD,
    "boi_token_id": BOI,
    "eoi_token_id": EOI,
    "boa_token_id": BOA,
    "eoa_token_index": EOA,
}


def tiny_gemma4() -> Any:
    """Gemma 4: sliding (vision blocks both ways) + full text layers with per-layer inputs; vision and audio towers."""
    text = {**_GEMMA4_TEXT, "vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 8}
    vision = {
        **_TOWER,
        "num_key_value_heads": 4,
        "head_dim": 8,
        "patch_size": PATCH,
        "pooling_kernel_size": KERNEL,
        "position_embedding_size": 64,
    }
    audio = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "subsampling_conv_channels": [MEL, 4],
        "output_proj_dims": 32,
        "attention_chunk_size": 4,
        "attention_context_left": 5,
    }
    return vlm("Gemma4", text_config=text, vision_config=vision, audio_config=audio, **_IDS)


def tiny_gemma4_unified() -> Any:
    """Gemma 4 Unified: no towers; patches and audio frames projected straight into the text model."""
    vision = {"patch_size": PATCH // KERNEL, "pooling_kernel_size": KERNEL, "mm_embed_dim": 32, "mm_posemb_size": 64}
    vision["output_proj_dims"] = 32
    audio = {"audio_embed_dim": MEL}
    return vlm("Gemma4Unified", text_config=_GEMMA4_TEXT, vision_config=vision, audio_config=audio, **_IDS)


@functools.cache
def cached_gemma4(name: str) -> Any:
    return {"gemma4": tiny_gemma4, "gemma4_unified": tiny_gemma4_unified}[name]()


def _rand(seed: int, *shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed))


@dataclass(frozen=True)
class Medium:
    """One medium: its kind, per-kind tensors (rows of one image, a video's frames, one clip) and its tokens."""

    kind: str
    rows: dict[str, torch.Tensor]
    tokens: tuple[int, ...]
    #: Offset of its first placeholder in `tokens`.
    first: int


def _patches(seed: int, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A frame of `height x width` patches as the processor gives it: rows padded to `MAX_PATCHES`."""
    n = height * width
    pixels = torch.zeros(MAX_PATCHES, 3 * PATCH * PATCH)
    pixels[:n] = _rand(seed, n, 3 * PATCH * PATCH)
    positions = torch.full((MAX_PATCHES, 2), -1, dtype=torch.long)
    grid_x, grid_y = torch.meshgrid(torch.arange(width), torch.arange(height), indexing="xy")
    positions[:n] = torch.stack([grid_x, grid_y], dim=-1).reshape(n, 2)
    return pixels, positions


class Gemma4Family:
    """Builds one family's media, their placeholders and a prompt's media kwargs."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.model = cached_gemma4(name)
        self.pooled = name == "gemma4"

    def _count(self, patches: int) -> int:
        return patches // KERNEL**2 if self.pooled else patches

    def image(self, seed: int) -> Medium:
        height, width = [(4, 4), (4, 4), (2, 4)][seed % 3]
        pixels, positions = _patches(seed, height, width)
        tokens = (BOI, *[IMG] * self._count(height * width), EOI)
        return Medium("image", {"pixel_values": pixels[None], "image_position_ids": positions[None]}, tokens, 1)

    def video(self, seed: int, frames: int = 2) -> Medium:
        """`frames` frames of 2x4 patches, each after its timestamp text (ids 20 + i, 9)."""
        rows = [_patches(seed * 7 + f, 2, 4) for f in range(frames)]
        tokens: list[int] = []
        for f in range(frames):
            tokens += [20 + f, 9, BOI, *[VID] * self._count(8), EOI]
        return Medium(
            "video",
            {
                "pixel_values_videos": torch.stack([p for p, _ in rows]),
                "video_position_ids": torch.stack([q for _, q in rows]),
                "num_frames_per_video": torch.tensor([frames]),
            },
            tuple(tokens),
            3,
        )

    def clip(self, seed: int, frames: int = 40) -> Medium:
        """An audio clip of `frames` valid rows (padded to `CLIP_ROWS` as the feature extractor pads a prompt's clips)."""
        features = torch.zeros(CLIP_ROWS, MEL)
        features[:frames] = _rand(seed, frames, MEL)
        mask = torch.zeros(CLIP_ROWS, dtype=torch.bool)
        mask[:frames] = True
        count = frames
        if self.pooled:
            for _ in range(2):  # the tower's two stride-2 subsamplings, as the processor counts them
                count = (count + 1) // 2
        tokens = (BOA, *[AUD] * count, EOA)
        return Medium("audio", {"input_features": features[None], "input_features_mask": mask[None]}, tokens, 1)

    def placeholders(self, medium: Medium) -> torch.Tensor:
        return torch.tensor([list(medium.tokens)])

    def marks(self, ids: torch.Tensor) -> torch.Tensor:
        """The processor's `mm_token_type_ids`."""
        marks = torch.zeros_like(ids)
        for token_id, code in ((IMG, 1), (VID, 2), (AUD, 3)):
            marks[ids == token_id] = code
        return marks

    def kwargs(self, ids: torch.Tensor, media: list[Medium]) -> dict[str, Any]:
        """What the processor hands `generate` for `ids` holding `media` in prompt order."""
        out: dict[str, Any] = {"mm_token_type_ids": self.marks(ids)}
        names = {m_name for m in media for m_name in m.rows}
        for name in sorted(names):
            rows = [m.rows[name] for m in media if name in m.rows]
            out[name] = torch.cat(rows)
        return out


def _sweep(name: str) -> registry.SweepCase:
    """Gemma 4 / Gemma 4 Unified in the support matrix's scenario: A an image; C an audio clip, text, then a video."""
    fam = Gemma4Family(name)
    return registry.mixed_sweep(fam.model, fam.placeholders, registry.mixed(fam.image, fam.clip, fam.video), fam.kwargs)


for _name in FAMILIES:
    registry.register_sweep(_name, partial(_sweep, _name))
