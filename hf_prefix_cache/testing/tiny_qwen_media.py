"""Tiny random-weight Qwen2.5-Omni thinker, and the prompts and media of Qwen3-VL videos and Omni.

Ids follow ``tiny_vlms`` (text ids in ``[4, 100)``, media ids above 100): images 120, videos 121,
vision start/end 122/123, audio start/end 124/125, audio placeholders 126.

* ``tiny_qwen2_5_omni_thinker``: an audio encoder (clips of 100 mel frames, 16 bins, attention
  within chunks of 50 frames), a Qwen2.5-VL-style vision encoder (2x2 patches, 2x2 merge) and an
  M-RoPE text model. ``position_id_per_seconds=2`` and ``seconds_per_chunk=1`` make the
  audio-in-video interleaving chunks 2 positions long, so a short clip splits into many runs.
* Qwen3-VL videos: a video of grid ``(t, h, w)`` is ``t`` frames, each written as its timestamp
  text, vision start, ``h*w/4`` placeholders and vision end (``qwen3_video_tokens``).
* ``Media`` collects one prompt's images, videos and clips and builds their ``generate`` kwargs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import transformers

from hf_prefix_cache.testing.tiny_vlm_media import audio_tokens, run
from hf_prefix_cache.testing.tiny_vlm_parts import (
    _MEDIA_INDEX,
    _QWEN_TOWER,
    _TEXT,
    _WHISPER,
    AUDIO_ID,
    IMAGE_ID,
    MEL_BINS,
    MEL_FRAMES,
    VIDEO_ID,
    VISION_END_ID,
    VISION_START_ID,
    _build,
)

AUDIO_START_ID, AUDIO_END_ID = 124, 125
POSITION_ID_PER_SECONDS, SECONDS_PER_CHUNK = 2, 1


def tiny_qwen2_5_omni_thinker() -> Any:
    """Qwen2.5-Omni thinker: audio, image and video encoders feeding an M-RoPE text model."""
    config = transformers.Qwen2_5OmniThinkerConfig(  # type: ignore[call-arg]
        text_config={
            **_TEXT,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]},
        },
        vision_config={
            "depth": 1,
            **_QWEN_TOWER,
            "window_size": 8,
            "fullatt_block_indexes": [0],
        },
        audio_config={
            **_WHISPER,
            "max_source_positions": MEL_FRAMES // 2,
            "n_window": 25,
            "output_dim": 64,
        },
        audio_token_index=AUDIO_ID,
        **_MEDIA_INDEX,
        audio_start_token_id=AUDIO_START_ID,
        audio_end_token_id=AUDIO_END_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
        position_id_per_seconds=POSITION_ID_PER_SECONDS,
        seconds_per_chunk=SECONDS_PER_CHUNK,
    )
    return _build(transformers.Qwen2_5OmniThinkerForConditionalGeneration, config)


@functools.cache
def cached_omni() -> Any:
    """One Omni thinker per session."""
    return tiny_qwen2_5_omni_thinker()


# --------------------------------------------------------------------------- media


def patches(seed: int, grid: tuple[int, int, int]) -> torch.Tensor:
    """``t*h*w`` flattened patch rows (``3*2*2*2`` values each) of an image or video of `grid`."""
    t, h, w = grid
    return torch.rand(t * h * w, 3 * 2 * 2 * 2, generator=torch.Generator().manual_seed(seed))


def clip(seed: int, frames: int, padded: int = MEL_FRAMES) -> tuple[torch.Tensor, torch.Tensor]:
    """One audio clip: ``[16, padded]`` mel features (zeros past `frames`) and its frame mask."""
    features = torch.zeros(MEL_BINS, padded)
    features[:, :frames] = torch.rand(MEL_BINS, frames, generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros(padded, dtype=torch.long)
    mask[:frames] = 1
    return features, mask


@dataclass
class Media:
    """One prompt's media in prompt order per kind, and the `generate` kwargs they make."""

    images: list[tuple[int, tuple[int, int, int]]] = field(default_factory=list)
    videos: list[tuple[int, tuple[int, int, int], float]] = field(default_factory=list)
    clips: list[tuple[int, int]] = field(default_factory=list)
    clip_padding: int = MEL_FRAMES

    def kwargs(self, ids: torch.Tensor, *, qwen3: bool = False, audio_in_video: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.images:
            out["pixel_values"] = torch.cat([patches(s, g) for s, g in self.images])
            out["image_grid_thw"] = torch.tensor([list(g) for _, g in self.images])
        if self.videos:
            out["pixel_values_videos"] = torch.cat([patches(s, g) for s, g, _ in self.videos])
            out["video_grid_thw"] = torch.tensor([list(g) for _, g, _ in self.videos])
            if not qwen3:
                out["video_second_per_grid"] = torch.tensor([sec for _, _, sec in self.videos])
        if self.clips:
            pairs = [clip(s, f, self.clip_padding) for s, f in self.clips]
            out["input_features"] = torch.stack([f for f, _ in pairs])
            out["feature_attention_mask"] = torch.stack([m for _, m in pairs])
        if qwen3:
            out["mm_token_type_ids"] = (ids == IMAGE_ID).int() + 2 * (ids == VIDEO_ID).int()
        if audio_in_video:
            out["use_audio_in_video"] = True
        return out


# --------------------------------------------------------------------------- prompt pieces


def image_tokens(grid: tuple[int, int, int]) -> torch.Tensor:
    """Vision start, ``t*h*w/4`` image placeholders, vision end."""
    t, h, w = grid
    return torch.cat([run(VISION_START_ID, 1), run(IMAGE_ID, t * h * w // 4), run(VISION_END_ID, 1)], dim=1)


def omni_video_tokens(grid: tuple[int, int, int]) -> torch.Tensor:
    """An Omni (or Qwen2-VL) video: vision start, ``t*h*w/4`` video placeholders, vision end."""
    t, h, w = grid
    return torch.cat([run(VISION_START_ID, 1), run(VIDEO_ID, t * h * w // 4), run(VISION_END_ID, 1)], dim=1)


def omni_audio_tokens(frames: int) -> torch.Tensor:
    """Audio start, the placeholders of a clip of `frames` valid mel frames, audio end."""
    return torch.cat([run(AUDIO_START_ID, 1), run(AUDIO_ID, audio_tokens(frames)), run(AUDIO_END_ID, 1)], dim=1)


def omni_audio_in_video_tokens(grid: tuple[int, int, int], seconds: float, frames: int) -> torch.Tensor:
    """A video with its soundtrack (`use_audio_in_video`): video and audio placeholders alternate per time chunk.

    Mirrors `Qwen2_5OmniProcessor.replace_video_with_audio_token`, framed by vision start,
    audio start, ..., audio end, vision end.
    """
    t, h, w = grid
    video_times = np.repeat(np.arange(t), h * w // 4) * seconds * POSITION_ID_PER_SECONDS
    audio_times = np.arange(audio_tokens(frames))
    per_chunk = int(POSITION_ID_PER_SECONDS * SECONDS_PER_CHUNK)
    chunked = transformers.Qwen2_5OmniProcessor.get_chunked_index
    video_chunks, audio_chunks = chunked(None, video_times, per_chunk), chunked(None, audio_times, per_chunk)  # type: ignore[arg-type]
    ids = [VISION_START_ID, AUDIO_START_ID]
    for j in range(max(len(video_chunks), len(audio_chunks))):
        if j < len(video_chunks):
            ids += [VIDEO_ID] * (video_chunks[j][1] - video_chunks[j][0])
        if j < len(audio_chunks):
            ids += [AUDIO_ID] * (audio_chunks[j][1] - audio_chunks[j][0])
    ids += [AUDIO_END_ID, VISION_END_ID]
    return torch.tensor([ids])


def timestamp(seconds: float) -> torch.Tensor:
    """The text ids a Qwen3-VL prompt writes before a frame (a stand-in for ``<0.5 seconds>``)."""
    digits = [4 + int(c) for c in f"{seconds:.1f}" if c.isdigit()]
    return torch.tensor([[90, *digits, 91]])


def qwen3_video_tokens(grid: tuple[int, int, int], seconds: float = 0.5) -> torch.Tensor:
    """A Qwen3-VL video: per frame its timestamp, vision start, ``h*w/4`` placeholders, vision end."""
    t, h, w = grid
    frames = [
        torch.cat(
            [
                timestamp(seconds * (2 * i + 1)),
                run(VISION_START_ID, 1),
                run(VIDEO_ID, h * w // 4),
                run(VISION_END_ID, 1),
            ],
            dim=1,
        )
        for i in range(t)
    ]
    return torch.cat(frames, dim=1)


class EncoderCalls:
    """Counts what the named encoder modules of a model see while active (rows or frames per call)."""

    def __init__(self, model: Any, towers: dict[str, str]) -> None:
        self.model, self.towers = model, towers
        self.seen: dict[str, list[int]] = {name: [] for name in towers}

    def __enter__(self) -> EncoderCalls:
        self._handles = []
        for name, attr in self.towers.items():

            def record(_m: Any, args: tuple[Any, ...], kwargs: dict[str, Any], _o: Any, name: str = name) -> None:
                first = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
                # Vision towers take patch rows [rows, dim]; the Omni audio tower takes frames [mel, frames].
                self.seen[name].append(int(first.shape[-1] if name == "audio" else first.shape[0]))

            module = getattr(self.model.model, attr)
            self._handles.append(module.register_forward_hook(record, with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()

    def total(self, name: str) -> int:
        return sum(self.seen[name])
