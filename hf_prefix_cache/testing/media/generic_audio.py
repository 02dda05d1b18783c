"""Tiny models of the generic families that take audio: Voxtral's mel chunks, GLM-ASR's and OmniASR's padded clips.

Each is built from its config classes (float32, eager, seed 0); `generic_models` names them.
"""

from __future__ import annotations

from typing import Any

from hf_prefix_cache.testing.media.generic_ids import AUD
from hf_prefix_cache.testing.tiny_vlm_parts import _TOWER, text_config, vlm

#: The audio tower Voxtral and GLM-ASR share: the tiny tower with an MLP of 128, on 16 mel bins.
_AUDIO: dict[str, Any] = {**_TOWER, "intermediate_size": 128, "num_mel_bins": 16}


def tiny_voxtral() -> Any:
    """Voxtral: 40-frame chunks of 16 mel bins, 5 placeholders per chunk."""
    audio = {**_AUDIO, "max_source_positions": 20, "vocab_size": 128}
    return vlm("Voxtral", text_config=text_config("llama"), audio_config=audio, audio_token_id=AUD)


def tiny_glmasr() -> Any:
    """GLM-ASR: clips of 16 mel bins padded to 40 frames; 40 valid frames give 5 placeholders, 24 give 3."""
    audio = {**_AUDIO, "num_key_value_heads": 4, "max_position_embeddings": 64}
    return vlm("GlmAsr", text_config=text_config("llama"), audio_config=audio, audio_token_id=AUD)


def tiny_omniasr() -> Any:
    """OmniASR (transformers 5.24 on): clips of raw samples padded to 100, a conv stack of kernels 10, 3 and
    strides 5, 2: 100 valid samples give 9 placeholders, 60 give 5."""
    audio = {
        **_TOWER,
        "conv_dim": [8, 8],
        "conv_kernel": [10, 3],
        "conv_stride": [5, 2],
        "num_hidden_layers": 1,
        "num_conv_pos_embeddings": 4,
        "num_conv_pos_embedding_groups": 2,
        "hidden_dropout": 0.0,
        "layerdrop": 0.0,
        "activation_dropout": 0.0,
    }
    return vlm("OmniASR", text_config=text_config("llama"), audio_config=audio, audio_token_id=AUD)
