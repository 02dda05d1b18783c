"""A tiny Gemma 3n and its media (images, audio clips), for its media tests and the sweep.

Gemma 3n's vision tower is a timm model (MobileNetV5): building the model needs timm and torchvision
(`.timm-packages`, as `tests/media/test_gemma3n_env.py` and the support matrix's timm worker put them on
the path); this module imports without them.

The tiny model mirrors the real layout: a text vocabulary of 128 ids, then 16 vision ids (the
first is the end-of-image id, the second the image placeholder) and 16 audio ids (end-of-audio,
then the audio placeholder), so placeholders and end markers take the towers' hard embeddings and
no per-layer token input, as in the real model. Four text layers, the last two sharing the first
two's keys/values, sliding window 8; the real MobileNetV5 encoder shrunk by `channel_multiplier`
(4 soft tokens per 32x32 image); a two-layer conformer (4 soft tokens per clip of up to 64 mel
frames). An image is ``<boi> IMG x4 <eoi>``, a clip ``<boa> AUD x4 <eoa>``; the processor's
`token_type_ids` are passed every time (the model never reads them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.tiny_build import _ATTN
from hf_prefix_cache.testing.tiny_vlm_parts import vlm

BOI, EOI, IMG = 110, 128, 129  # end-of-image and image ids open the vision vocabulary (offset 128), as in Gemma 3n
BOA, EOA, AUD = 112, 144, 145  # end-of-audio and audio ids open the audio vocabulary (offset 144)
#: The framing and placeholder ids under their config keys.
_IDS: dict[str, Any] = {
    "boi_token_id": BOI,
    "eoi_token_id": EOI,
    "image_token_id": IMG,
    "boa_token_id": BOA,
    "eoa_token_id": EOA,
    "audio_token_id": AUD,
}
SPECIAL_IDS = list(range(100, 160))  # answers stay in text ids below 100
FRAMES, MELS = 48, 16  # every clip: 48 mel frames (its valid part, then zero padding) of 16 bins


@functools.cache
def tiny_gemma3n() -> Any:
    """A tiny random-weight Gemma 3n (float32, eager, seed 0) with the real timm encoder, shrunk."""
    text_config = {
        **_ATTN,
        "vocab_size": 160,
        "vocab_size_per_layer_input": 128,
        "hidden_size_per_layer_input": 8,
        "num_hidden_layers": 4,
        "num_kv_shared_layers": 2,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "sliding_window": 8,
        "head_dim": 16,
        "altup_num_inputs": 2,
        "laurel_rank": 8,
        "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": None,
    }
    vision = {
        "architecture": "mobilenetv5_300m_enc",
        "model_args": {"channel_multiplier": 0.0625, "msfa_output_resolution": 2},
        "hidden_size": 2048,  # the encoder's fixed output width
        "vocab_size": 16,
        "vocab_offset": 128,
    }
    audio = {
        "vocab_size": 16,
        "vocab_offset": 144,
        "input_feat_size": MELS,
        "hidden_size": 32,
        "conf_num_attention_heads": 4,
        "conf_num_hidden_layers": 2,
        "sscp_conv_channel_size": [8, 4],
        "conf_conv_kernel_size": 3,
        "conf_attention_chunk_size": 4,
        "conf_attention_context_left": 5,
    }
    soft_tokens = {"vision_soft_tokens_per_image": 4, "audio_soft_tokens_per_image": 4}
    return vlm("Gemma3n", text_config=text_config, vision_config=vision, audio_config=audio, **soft_tokens, **_IDS)


def _rand(seed: int, *shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@dataclass(frozen=True)
class Medium:
    """An image (`data` ``[3, 32, 32]``) or a clip (`data` ``[FRAMES, MELS]`` and its frame `mask`), with its tokens."""

    kind: str
    data: torch.Tensor
    mask: torch.Tensor | None
    tokens: tuple[int, ...]
    spans: tuple[tuple[int, int], ...] = ((1, 5),)


def medium(seed: int) -> Medium:
    """Pool medium `seed`: a clip for seeds 2, 5, 8, ... (each its own valid length), an image otherwise."""
    if seed % 3 != 2:
        return Medium("image", _rand(seed, 3, 32, 32), None, (BOI, *[IMG] * 4, EOI))
    valid = 20 + seed * 7 % 28
    mask = torch.arange(FRAMES) < valid
    return Medium("audio", _rand(seed, FRAMES, MELS) * mask[:, None], mask, (BOA, *[AUD] * 4, EOA))


def placeholders(m: Medium) -> torch.Tensor:
    return torch.tensor([list(m.tokens)])


def token_types(ids: torch.Tensor) -> torch.Tensor:
    """What the processor returns as `token_type_ids`: 1 on image placeholders, 3 on audio ones."""
    return (ids == IMG).long() + 3 * (ids == AUD).long()


def media_kwargs(ids: torch.Tensor, media: list[Medium]) -> dict[str, Any]:
    """What the processor hands `generate` for `media` in prompt order."""
    out: dict[str, Any] = {"token_type_ids": token_types(ids)}
    images = [m.data for m in media if m.kind == "image"]
    clips = [m for m in media if m.kind == "audio"]
    if images:
        out["pixel_values"] = torch.stack(images)
    if clips:
        out["input_features"] = torch.stack([c.data for c in clips])
        out["input_features_mask"] = torch.stack([c.mask for c in clips if c.mask is not None])
    return out


def _sweep() -> registry.SweepCase:
    """Gemma 3n in the support matrix's scenario: A and B images of one shape; C a clip (the audio tower).

    Its end markers and placeholders are ids 128-159, past the sweep's own 100-127: answers never hold them.
    """
    media = {name: medium(seed) for name, seed in registry.three(lambda seed: seed).items()}
    return registry.SweepCase(
        tiny_gemma3n(),
        {name: placeholders(m) for name, m in media.items()},
        lambda ids, names: media_kwargs(ids, [media[n] for n in names]),
        first=1,
        suppress=tuple(range(128, 160)),
    )


registry.register_sweep("gemma3n", _sweep)
