"""A tiny MOSS Transcribe-Diarize and its audio clips (Whisper windows with time markers), for its tests and the sweep.

Its Whisper-style tower reads windows of 40 frames of 16 mel bins; a window of ``v`` valid
frames gives ``ceil(((v - 1) // 2 + 1) / 2)`` placeholders (120; merge size 2). A clip is one
or more windows; its placeholders are framed by audio begin/end ids (110/111) and, as the
processor writes them, a second-count text id (``60 + seconds``) follows every 4 placeholders
(2 placeholders a second, a marker every 2 seconds). Pool seeds 1 and 13 give one clip layout,
other features; seed 2 a clip of two windows.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.media.arrays import padded
from hf_prefix_cache.testing.media.pool import Seeded
from hf_prefix_cache.testing.tiny_vlm_parts import _TOWER, text_config, vlm

AUD, AUDIO_BOS, AUDIO_EOS = 120, 110, 111
FRAMES, MELS, MERGE = 40, 16, 2
PER_MARKER = 4
NEW = 4
SPECIAL_IDS = list(range(100, 128))
#: Valid frames of each window of a clip, per pool seed (seeds 1 and 13 alike).
WINDOWS = [[40], [40], [40, 25]]


@functools.cache
def tiny_moss() -> Any:
    """MOSS Transcribe-Diarize: a one-layer Whisper-style tower (40-frame windows), merge 2, a Qwen3 text model."""
    return vlm(
        "MossTranscribeDiarize",
        audio_config={**_TOWER, "num_mel_bins": MELS, "num_hidden_layers": 1, "max_source_positions": FRAMES // 2},
        text_config=text_config("qwen3", head_dim=16),
        audio_token_id=AUD,
        audio_merge_size=MERGE,
    )


class Clip(Seeded):
    @property
    def windows(self) -> list[int]:
        return WINDOWS[self.seed % 3]

    def counts(self) -> list[int]:
        """Each window's placeholders."""
        return [-(-((v - 1) // 2 + 1) // MERGE) for v in self.windows]

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Its windows' feature rows (zeros past the valid frames) and mask rows."""
        gen = torch.Generator().manual_seed(self.seed)
        windows = [(torch.rand(MELS, valid, generator=gen) * 2 - 1).T for valid in self.windows]
        features, mask = padded(windows, FRAMES)
        return features.transpose(1, 2).contiguous(), mask


def placeholders(clip: Clip) -> torch.Tensor:
    """Its placeholders, a second-count marker after every 4, framed by audio begin/end ids."""
    tokens: list[int] = [AUDIO_BOS]
    for k in range(sum(clip.counts())):
        tokens.append(AUD)
        if (k + 1) % PER_MARKER == 0:
            tokens.append(60 + 2 * (k + 1) // PER_MARKER)
    return torch.tensor([[*tokens, AUDIO_EOS]])


def media_kwargs(clips: list[Clip]) -> dict[str, Any]:
    """What the processor hands `generate`: every clip's windows in order, and each clip's valid-sample mask."""
    if not clips:
        return {}
    rows = [c.rows() for c in clips]
    samples = [sum(c.windows) * 10 for c in clips]
    padding_mask = torch.zeros(len(clips), max(samples), dtype=torch.long)
    for i, n in enumerate(samples):
        padding_mask[i, :n] = 1
    return {
        "input_features": torch.cat([f for f, _ in rows]),
        "input_features_mask": torch.cat([m for _, m in rows]),
        "padding_mask": padding_mask,
    }


# The sweep's C is a clip of two windows; time markers inside.
registry.register_single("moss_transcribe_diarize", tiny_moss, "audio", Clip, placeholders, media_kwargs, framing=1)
