"""A tiny VibeVoice ASR and its audio clips, for its media tests and the sweep.

Two causal conv tokenizers (acoustic, semantic) of two 2x downsamplings: one placeholder per
started hop of 4 valid samples. A prompt's clips are rows of raw samples (`[clips, 1, samples]`)
padded to the longest, a multiple of the hop, with `padding_mask` their valid samples, as its
feature extractor pads them. A clip is framed by audio begin/end ids (110/111), its placeholders
120. Pool seeds 1 and 13 give one length, other samples.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.media.cases import single
from hf_prefix_cache.testing.tiny_vlm_parts import text_config, vlm

AUD, AUDIO_BOS, AUDIO_EOS = 120, 110, 111
HOP = 4
NEW = 4
SPECIAL_IDS = list(range(100, 128))
#: Valid samples per pool seed (seeds 1 and 13 alike): 10, 10 and 7 placeholders.
SAMPLES = [40, 38, 27]
_TOKENIZER = {
    "hidden_size": 16,
    "num_filters": 4,
    "downsampling_ratios": [2, 2],
    "depths": [1, 1, 1],
    "kernel_size": 3,
    "ffn_expansion": 2,
}


@functools.cache
def tiny_vibevoice_asr() -> Any:
    """VibeVoice ASR: tiny acoustic and semantic tokenizers (hop 4) over a 2-layer Qwen2 text model."""
    return vlm(
        "VibeVoiceAsr",
        text_config=text_config("qwen2"),
        acoustic_tokenizer_encoder_config=dict(_TOKENIZER),
        semantic_tokenizer_encoder_config=dict(_TOKENIZER),
        audio_token_id=AUD,
        audio_bos_token_id=AUDIO_BOS,
        audio_eos_token_id=AUDIO_EOS,
        acoustic_tokenizer_chunk_size=512 * HOP,
    )


@dataclass(frozen=True)
class Clip:
    seed: int

    @property
    def samples(self) -> int:
        return SAMPLES[self.seed % 3]

    @property
    def size(self) -> int:
        """Its placeholders: one per started hop of valid samples."""
        return -(-self.samples // HOP)

    def values(self) -> torch.Tensor:
        return torch.rand(self.samples, generator=torch.Generator().manual_seed(self.seed)) * 2 - 1


def placeholders(clip: Clip) -> torch.Tensor:
    return torch.tensor([[AUDIO_BOS, *[AUD] * clip.size, AUDIO_EOS]])


def media_kwargs(clips: list[Clip], sample: bool | None = False) -> dict[str, Any]:
    """What the processor hands `generate` for `clips`, and `sample` (False: no noise; None: left at the default)."""
    out: dict[str, Any] = {} if sample is None else {"sample": sample}
    if not clips:
        return out
    length = -(-max(c.samples for c in clips) // HOP) * HOP
    values = torch.zeros(len(clips), 1, length)
    mask = torch.zeros(len(clips), length, dtype=torch.bool)
    for i, c in enumerate(clips):
        values[i, 0, : c.samples], mask[i, : c.samples] = c.values(), True
    return {**out, "input_values": values, "padding_mask": mask}


def _sweep() -> registry.SweepCase:
    """VibeVoice ASR in the support matrix's scenario: A a clip, C another; calls pass ``sample=False`` (no noise)."""
    media = registry.three(Clip)
    tokens = {k: placeholders(m) for k, m in media.items()}
    return registry.SweepCase(
        tiny_vibevoice_asr(), tokens, lambda _ids, names: media_kwargs([media[n] for n in names]), 1
    )


registry.register_sweep("vibevoice_asr", _sweep)


registry.register_suite(
    "vibevoice_asr",
    lambda: single("vibevoice_asr", tiny_vibevoice_asr(), "audio", Clip, placeholders, media_kwargs, framing=1),
)
