"""Tiny speech LMs of the generic table and their clips: Granite Speech (and Plus), Qwen3-ASR, Fun-ASR-Nano, Nemotron 3.5.

Each is built from its config classes (float32, eager, seed 0) over a 2-layer text model, and fed
clips as its processor pads them: a prompt's clips are rows padded to its longest clip (Qwen3-ASR:
to a multiple of its 100-frame chunks) with a mask of each row's valid part. A clip is framed by
audio begin/end ids (110/111), its placeholders 126. Pool seeds 1 and 13 give one length, other
content; seed 2 another length:

* ``granite_speech`` / ``granite_speech_plus``: rows of 16-value frames; the projector reads
  windows of 4 encoder frames, 2 outputs each; the mask marks each row's outputs (its
  placeholders). Seeds 1 and 13: 12 frames (6 placeholders); seed 2: 8 frames (4), shorter, so a
  prompt's first clip is never padded by a later one (its tower reads the padding: a re-padded
  clip keys otherwise).
* ``qwen3_asr``: rows ``[16 mel bins, frames]`` in chunks of 100 frames, three stride-2
  convolutions each (13 placeholders per whole chunk). Seeds 1 and 13: 60 frames (8); seed 2:
  140 frames (13 + 5), padding the first clip of its prompt to 200 frames.
* ``fun_asr_nano``: rows ``[frames, 8 features]``, one placeholder per valid frame. Seeds 1 and
  13: 7 frames; seed 2: 12, padding the first clip of its prompt.
* ``nemo_speechlm`` (Nemotron 3.5 Transcribe; Nemotron-H text layers with states): rows ``[frames,
  16 mel bins]`` padded to a multiple of 8 frames, one placeholder per started 8 valid frames; its
  placeholder id 128 lies past the text vocabulary, as NVIDIA's tokenizer appends it. Seeds 1 and 13:
  40 frames (5 placeholders); seed 2: 27 (4), shorter (its clips key with their padding).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import transformers

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.media.arrays import padded, seeded_rand
from hf_prefix_cache.testing.media.generic_ids import AUD
from hf_prefix_cache.testing.tiny_vlm_parts import _NEMOTRON_H_TEXT, _TEXT, _TOWER, _WHISPER, _build, text_config, vlm

AUDIO_BOS, AUDIO_EOS = 110, 111
#: Granite Speech: encoder frames per projector window, and its outputs per window.
GRANITE_WINDOW, GRANITE_QUERIES = 4, 2
#: Qwen3-ASR: mel frames per chunk (`2 * n_window`; its tower's lengths hold for 50 only).
QWEN3_ASR_CHUNK = 100


def _granite_config(config_cls: type, encoder: dict[str, Any]) -> Any:
    projector = {
        **_TOWER,
        "model_type": "blip_2_qformer",
        "num_hidden_layers": 1,
        "encoder_hidden_size": encoder["hidden_dim"] * (len(encoder.get("cat_hidden_layers") or []) + 1),
        "cross_attention_frequency": 1,
        "vocab_size": 128,
    }
    return config_cls(
        text_config=text_config("granite"),
        encoder_config=encoder,
        projector_config=projector,
        audio_token_id=AUD,
        has_lora_adapter=False,  # a LoRA adapter keeps its media cold (see `multimodal/generic_table_rows.py`)
        window_size=GRANITE_WINDOW,
        downsample_rate=GRANITE_WINDOW // GRANITE_QUERIES,
    )


_GRANITE_ENCODER = {
    "input_dim": 16,
    "num_layers": 2,
    "hidden_dim": 32,
    "feedforward_mult": 2,
    "num_heads": 4,
    "dim_head": 8,
    "output_dim": 8,
    "context_size": 8,
    "max_pos_emb": 16,
    "conv_kernel_size": 3,
    "conv_expansion_factor": 2,
}


@functools.cache
def tiny_granite_speech() -> Any:
    """Granite Speech: a 2-block conformer (attention blocks of 8 frames), a 1-layer Q-Former over windows of 4."""
    config = _granite_config(transformers.GraniteSpeechConfig, dict(_GRANITE_ENCODER))
    return _build(transformers.GraniteSpeechForConditionalGeneration, config)


@functools.cache
def tiny_granite_speech_plus() -> Any:
    """Granite Speech Plus: Granite Speech's tiny model, the first block's output joined to the projector's input."""
    encoder = {**_GRANITE_ENCODER, "cat_hidden_layers": [1]}
    config = _granite_config(transformers.GraniteSpeechPlusConfig, encoder)
    return _build(transformers.GraniteSpeechPlusForConditionalGeneration, config)


@functools.cache
def tiny_qwen3_asr() -> Any:
    """Qwen3-ASR: 100-frame chunks of 16 mel bins, attention windows of 13 outputs, a 2-layer Qwen3 text model."""
    audio = {
        **_WHISPER,
        "n_window": QWEN3_ASR_CHUNK // 2,
        "n_window_infer": QWEN3_ASR_CHUNK,
        "downsample_hidden_size": 8,
        "output_dim": _TEXT["hidden_size"],
    }
    return vlm("Qwen3ASR", text_config=text_config("qwen3", head_dim=16), audio_config=audio, audio_token_id=AUD)


#: Fun-ASR-Nano's 3-layer SAN-M encoder (FSMN kernel 3) on 8-value frames.
_FUN_ASR_AUDIO: dict[str, Any] = {
    **_TOWER,
    "num_mel_bins": 4,
    "num_stacked_frames": 2,
    "num_hidden_layers": 3,
    "num_timestamp_prediction_layers": 1,
    "fsmn_kernel_size": 3,
    "max_position_embeddings": 64,
}

#: Its 1-layer adaptor.
_FUN_ASR_ADAPTOR: dict[str, Any] = {
    "hidden_size": _TEXT["hidden_size"],
    "num_attention_heads": 4,
    "intermediate_size": _TEXT["hidden_size"] // 4,
    "num_hidden_layers": 1,
    "projector_hidden_size": 32,
}


@functools.cache
def tiny_fun_asr_nano() -> Any:
    """Fun-ASR-Nano: a 3-layer SAN-M encoder (FSMN kernel 3) on 8-value frames, a 1-layer adaptor, Qwen3 text."""
    return vlm(
        "FunAsrNano",
        text_config=text_config("qwen3", head_dim=16),
        audio_config=_FUN_ASR_AUDIO,
        adaptor_config=_FUN_ASR_ADAPTOR,
        audio_token_id=AUD,
    )


#: Nemotron 3.5 Transcribe: its audio placeholder id (the text vocabulary's size) and mel frames per encoder frame.
NEMO_AUDIO, NEMO_STACK = _TEXT["vocab_size"], 8


@functools.cache
def tiny_nemo_speechlm() -> Any:
    """Nemotron 3.5 Transcribe: one-layer speech and diarization encoders (chunks of 4 encoder frames, one of
    context each side; a speaker cache of 8), Nemotron-H text [Mamba-2, attention, Mamba-2, MLP]."""
    encoder = {**_TOWER, "num_hidden_layers": 1, "num_mel_bins": 16, "subsampling_factor": NEMO_STACK}
    speakers = {"num_speakers": 4, "subsampling_factor": NEMO_STACK}
    diarization = {
        "audio_config": dict(encoder),
        "head_config": {**speakers, "hidden_size": 16, "audio_hidden_size": 32},
        "streaming_config": {**speakers, "fifo_length": 8, "speaker_cache_update_period": 4, "speaker_cache_length": 8},
        "chunk_length": 4,
        "chunk_left_context": 1,
        "chunk_right_context": 1,
        "fifo_length": 4,
        "speaker_cache_update_period": 4,
    }
    timestamps = {**_TOWER, "num_hidden_layers": 1, "vocab_size": 10, "blank_token_id": 9}
    return vlm(
        "Nemotron3_5Transcribe",
        text_config=_NEMOTRON_H_TEXT,
        audio_config={"asr_config": encoder, "diarization_config": diarization},
        word_timestamp_config=timestamps,
        audio_token_id=NEMO_AUDIO,
    )


@dataclass(frozen=True)
class Clip:
    """One clip of `family`: its valid frames (a random row per seed) and its placeholder count."""

    family: str
    seed: int

    @property
    def frames(self) -> int:
        return _FRAMES[self.family][self.seed % 3]

    @property
    def count(self) -> int:
        if self.family == "qwen3_asr":
            full, rest = divmod(self.frames, QWEN3_ASR_CHUNK)
            return full * 13 + (_three_convs(rest) if rest else 0)
        if self.family == "fun_asr_nano":
            return self.frames
        if self.family == "nemo_speechlm":
            return -(-self.frames // NEMO_STACK)
        return -(-self.frames // GRANITE_WINDOW) * GRANITE_QUERIES

    def values(self) -> torch.Tensor:
        """Its valid frames, `[frames, values]`."""
        width = {"qwen3_asr": 16, "fun_asr_nano": 8}.get(self.family, 16)
        return seeded_rand(self.frames, width, seed=self.seed) * 2 - 1


#: Valid frames per pool seed (`seed % 3`): seeds 1 and 13 alike, seed 2 another length.
_FRAMES = {
    "granite_speech": [12, 12, 8],
    "granite_speech_plus": [12, 12, 8],
    "qwen3_asr": [60, 60, 140],
    "fun_asr_nano": [7, 7, 12],
    "nemo_speechlm": [40, 40, 27],
}


def _three_convs(n: int) -> int:
    for _ in range(3):
        n = (n - 1) // 2 + 1
    return n


def placeholders(clip: Clip) -> torch.Tensor:
    audio = NEMO_AUDIO if clip.family == "nemo_speechlm" else AUD
    return torch.tensor([[AUDIO_BOS, *[audio] * clip.count, AUDIO_EOS]])


def media_kwargs(clips: list[Clip]) -> dict[str, Any]:
    """What the family's processor hands `generate` for `clips` in prompt order: rows padded to the longest."""
    if not clips:
        return {}
    family = clips[0].family
    longest = max(c.frames for c in clips)
    if family in ("qwen3_asr", "nemo_speechlm"):
        unit = QWEN3_ASR_CHUNK if family == "qwen3_asr" else NEMO_STACK
        longest = -(-longest // unit) * unit
    rows, frames_mask = padded([c.values() for c in clips], longest)
    if family == "qwen3_asr":
        return {"input_features": rows.transpose(1, 2).contiguous(), "input_features_mask": frames_mask}
    if family in ("fun_asr_nano", "nemo_speechlm"):
        return {"input_features": rows, "input_features_mask": frames_mask}
    # Granite Speech: the mask is over the projector's outputs, each clip's first `count`.
    counts = torch.tensor([c.count for c in clips])
    return {"input_features": rows, "input_features_mask": torch.arange(int(counts.max()))[None] < counts[:, None]}


#: The families built here, by their media-registry keys.
BUILDERS: dict[str, Callable[[], Any]] = {
    "granite_speech": tiny_granite_speech,
    "granite_speech_plus": tiny_granite_speech_plus,
    "qwen3_asr": tiny_qwen3_asr,
    "fun_asr_nano": tiny_fun_asr_nano,
    "nemo_speechlm": tiny_nemo_speechlm,
}
#: Those whose text layers hold recurrent states (restored only at a snapshot).
STATE_FAMILIES = ("nemo_speechlm",)


# The sweep's A is a clip, C another (shorter for Granite Speech).
for _name, _build_model in BUILDERS.items():
    registry.register_single(
        _name,
        _build_model,
        "audio",
        partial(Clip, _name),
        placeholders,
        media_kwargs,
        framing=1,
        states=_name in STATE_FAMILIES,
    )
