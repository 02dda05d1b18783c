"""Tiny Qwen3-Omni thinker and its media, as its tests and the sweep build them.

A Qwen3-VL-style vision tower (2x2 patches, 2x2 merge, deepstack at its first layer), a windowed
audio tower (chunks of 100 mel frames: ``n_window=50``, the window its placeholder formula
assumes; attention windows of two chunks) and MoE text layers with interleaved M-RoPE. Ids as
`tiny_qwen_media` (images 120, videos 121, vision start/end 122/123, audio start/end 124/125,
audio placeholders 126), and its `Media` builds the kwargs. ``position_id_per_seconds=2``: a
video of ``0.75`` seconds per grid has temporal positions ``0, 1.5, 3, ...``, which the model
keeps as floats.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import transformers

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.tiny_qwen_media import AUDIO_END_ID, AUDIO_START_ID, Media, image_tokens
from hf_prefix_cache.testing.tiny_vlm_media import run
from hf_prefix_cache.testing.tiny_vlm_parts import _QWEN_IDS, _QWEN_TOWER, _TEXT, _WHISPER, AUDIO_ID, _build

#: Frames of one audio chunk (``2 * n_window``); a shorter clip is padded to its call's longest chunk.
CHUNK_FRAMES = 100


def tiny_qwen3_omni_thinker() -> Any:
    """Qwen3-Omni thinker: audio and vision towers feeding MoE text layers with interleaved M-RoPE."""
    rope = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3], "mrope_interleaved": True}
    text = {**_TEXT, "head_dim": 16, "rope_parameters": rope, "decoder_sparse_step": 1}
    moe = {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}
    config = transformers.Qwen3OmniMoeThinkerConfig(
        text_config={**text, **moe},
        vision_config={"depth": 2, **_QWEN_TOWER, "num_position_embeddings": 64, "deepstack_visual_indexes": [0]},
        audio_config={
            **_WHISPER,
            "max_source_positions": CHUNK_FRAMES,
            "n_window": CHUNK_FRAMES // 2,
            "n_window_infer": 2 * CHUNK_FRAMES,
            "downsample_hidden_size": 8,
            "output_dim": 64,
        },
        audio_token_id=AUDIO_ID,
        audio_start_token_id=AUDIO_START_ID,
        position_id_per_seconds=2,
        **{k: v for k, v in _QWEN_IDS.items() if k != "vision_end_token_id"},
    )
    model = _build(transformers.Qwen3OmniMoeThinkerForConditionalGeneration, config)
    with torch.no_grad():
        # Trained-scale convolutions: the padding a short clip's last feature reads then shows (1e-3).
        generator = torch.Generator().manual_seed(0)
        tower = model.model.audio_tower
        for conv in (tower.conv2d1, tower.conv2d2, tower.conv2d3):
            conv.weight.copy_(torch.randn(conv.weight.shape, generator=generator) * 0.5)
            conv.bias.copy_(torch.randn(conv.bias.shape, generator=generator) * 0.5)
    return model


@functools.cache
def cached_qwen3_omni() -> Any:
    """One Qwen3-Omni thinker per session."""
    return tiny_qwen3_omni_thinker()


def audio_tokens(frames: int) -> int:
    """Placeholders of a clip of `frames` valid mel frames: 13 per whole chunk, then its tail's three halvings."""
    whole, tail = divmod(frames, CHUNK_FRAMES)
    for _ in range(3):
        tail = (tail - 1) // 2 + 1 if tail else 0
    return 13 * whole + tail


def clip_tokens(frames: int) -> torch.Tensor:
    """Audio start, the placeholders of a clip of `frames` valid mel frames, audio end."""
    return torch.cat([run(AUDIO_START_ID, 1), run(AUDIO_ID, audio_tokens(frames)), run(AUDIO_END_ID, 1)], dim=1)


def omni_sweep(model: Any, clip_tokens: Callable[[int], torch.Tensor], frames: int, **media: Any) -> registry.SweepCase:
    """An Omni thinker's support-matrix scenario: media A and B a clip of `frames` valid mel frames (after an
    audio-start id, `clip_tokens`), C an image; `media` the `Media` options of its kwargs."""
    grid = (1, 4, 6)
    seeds = {"a": registry.SEED_A, "b": registry.SEED_B}
    tokens = {"a": clip_tokens(frames), "b": clip_tokens(frames), "c": image_tokens(grid)}

    def kwargs(ids: Any, names: Sequence[str]) -> dict[str, Any]:
        clips = [(seeds[n], frames) for n in names if n in seeds]
        images = [(registry.SEED_C, grid)] if "c" in names else []
        return Media(images=images, clips=clips, **media).kwargs(ids)

    return registry.SweepCase(model, tokens, kwargs, first=1)


registry.register_sweep(
    "qwen3_omni_moe_thinker",
    lambda: omni_sweep(cached_qwen3_omni(), clip_tokens, 140, clip_padding=2 * CHUNK_FRAMES),
)
