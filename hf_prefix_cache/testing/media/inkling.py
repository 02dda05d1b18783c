"""A tiny Inkling and its media (images as per-patch items, dMel audio clips), for its tests and the sweep."""

from __future__ import annotations

import functools
from typing import Any

import torch

from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.media.arrays import padded, seeded_rand
from hf_prefix_cache.testing.media.pool import PoolMedium, partial
from hf_prefix_cache.testing.tiny_build import _INKLING_ATTENTION, _ROUTED_EXPERTS
from hf_prefix_cache.testing.tiny_vlm_parts import vlm

IMG, AUD, IMAGE_BOS, AUDIO_BOS = 120, 126, 110, 111
NEW = 4
SPECIAL_IDS = list(range(100, 128))
#: Per pool seed (seeds 1 and 13 alike): an image's patches, a clip's valid frames (of 10, its padded length).
PATCHES, FRAMES, PADDED = [6, 6, 4], [7, 7, 5], 10
MEL_BINS, MEL_VOCAB = 8, 16
_TEXT = {
    "vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    **_INKLING_ATTENTION,
    "layer_types": ["hybrid_sliding", "hybrid"],
    "mlp_layer_types": ["sparse", "sparse"],
    "intermediate_size": 128,
    **_ROUTED_EXPERTS,
    "n_shared_experts": 1,
    "pad_token_id": 0,
    "eos_token_id": None,
}


@functools.cache
def tiny_inkling() -> Any:
    """Inkling: a patch-wise vision tower on 2 x 4x4-pixel patches, dMel audio (8 bins of 16 values); hybrid
    [sliding, full] text layers with conv states and experts."""
    return vlm(
        "Inkling",
        text_config=_TEXT,
        vision_config={"patch_size": 4, "hidden_size": 32, "n_layers": 2, "num_attention_heads": 4},
        audio_config={"n_mel_bins": MEL_BINS, "mel_vocab_size": MEL_VOCAB},
        image_token_id=IMG,
        audio_token_id=AUD,
        image_bos_token_id=IMAGE_BOS,
        audio_bos_token_id=AUDIO_BOS,
    )


class Medium(PoolMedium):
    @property
    def size(self) -> int:
        """Its placeholders: patches of an image, valid frames of a clip."""
        return (PATCHES if self.kind == "image" else FRAMES)[self.seed % 3]


image, clip = partial(Medium, "image"), partial(Medium, "audio")


def placeholders(medium: Medium) -> torch.Tensor:
    bos, token = (IMAGE_BOS, IMG) if medium.kind == "image" else (AUDIO_BOS, AUD)
    return torch.tensor([[bos, *[token] * medium.size]])


def media_kwargs(media: list[Medium]) -> dict[str, Any]:
    """What the processor hands `generate`: all images' patch rows; clips padded to 10 frames with their mask."""
    out: dict[str, Any] = {}
    images = [m for m in media if m.kind == "image"]
    if images:
        out["pixel_values"] = torch.cat([seeded_rand(m.size, 2, 4, 4, 3, seed=m.seed) for m in images])
    clips = [m for m in media if m.kind == "audio"]
    if clips:
        rows = [
            torch.randint(
                0, MEL_VOCAB, (m.size, MEL_BINS), generator=torch.Generator().manual_seed(m.seed), dtype=torch.int32
            )
            for m in clips
        ]
        out["audio_input_ids"], out["audio_input_ids_mask"] = padded(rows, PADDED, torch.int32)
    return out


registry.register_mixed(
    "inkling_mm_model", tiny_inkling, placeholders, media_kwargs, {"image": image, "audio": clip}, states=True
)
