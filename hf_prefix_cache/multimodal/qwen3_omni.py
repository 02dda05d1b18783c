"""Qwen3-Omni thinker: Qwen2.5-Omni's items and positions, with its windowed audio tower's padding.

Its vision tower is Qwen3-VL's (deepstack features, attention within each frame), its prompts
are Qwen2.5-Omni's (a video is one run of placeholders; with `use_audio_in_video` a video and
its clip interleave in one block), and its `get_rope_index` takes the same arguments, so the
Qwen2.5-Omni adapter serves it with two differences:

* Clip lengths: a clip of `n` valid mel frames has the placeholders of the model's own
  `_get_feat_extract_output_lengths(n, n_window)` (13 per full chunk of `2 * n_window` frames).
* Padding: the audio tower cuts every clip into chunks of `2 * n_window` frames and pads each
  call's chunks to its longest one before three stride-2 convolutions, whose last valid output
  reads the padding. A clip shorter than a chunk therefore has other features beside a longer
  clip (1e-3 on its last feature with trained-scale weights): the call's padded chunk length
  (`2 * n_window`, or its longest clip's frames when every clip is shorter) is hashed with each
  clip, and a hit whose suffix clips alone would be padded to less gets one all-zero clip of
  the call's chunk length after them. The thinker scatters audio features in order with no
  count check, so the features past the suffix's placeholders (that clip's) are never read.

Its positions from `get_rope_index` are floats (a video's temporal spacing need not be whole),
and so are the cold run's: they are passed as they are, never rounded.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_prefix_cache.multimodal.media import MediaLayout
from hf_prefix_cache.multimodal.qwen_omni import Qwen2_5OmniThinkerMedia
from hf_prefix_cache.multimodal.registry import MediaFamily, register


class Qwen3OmniThinkerMedia(Qwen2_5OmniThinkerMedia):
    """Qwen3-Omni thinker: Qwen2.5-Omni's items, each clip also keyed by its call's padded chunk length."""

    _whole_positions = False  # its (float) rope rows are passed as they are, as its cold run's

    def _chunk_len(self) -> int:
        return 2 * int(self.config.audio_config.n_window)

    def _padded_len(self, mask: torch.Tensor) -> int:
        """The length the audio tower pads a call's chunks to: a whole chunk, or its longest clip's frames."""
        return min(self._chunk_len(), int(mask.sum(-1).max())) if mask.shape[0] else 0

    def _clip_lens(self, mask: torch.Tensor) -> torch.Tensor:
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

        lengths: torch.Tensor = _get_feat_extract_output_lengths(  # type: ignore[no-untyped-call]
            mask.sum(-1), int(self.config.audio_config.n_window)
        )
        return lengths

    def _clip_extra(self, mask: torch.Tensor) -> tuple[Any, ...]:
        """The call's padded chunk length, which changes every clip's last features."""
        return (torch.tensor(self._padded_len(mask)),)

    def _slice(self, kwargs: dict[str, Any], layout: MediaLayout, cached_len: int) -> None:
        mask = kwargs.get("feature_attention_mask")
        padded = self._padded_len(mask) if isinstance(mask, torch.Tensor) else 0
        super()._slice(kwargs, layout, cached_len)
        features, kept = kwargs.get("input_features"), kwargs.get("feature_attention_mask")
        if features is None or kept is None or self._padded_len(kept) >= padded:
            return
        # The suffix's clips alone would be padded to less than in the whole call: one zero clip of the
        # call's chunk length after them restores it; its features follow the suffix's and are never read.
        pad_features = torch.zeros_like(features[:1])
        pad_mask = torch.zeros_like(kept[:1])
        pad_mask[:, :padded] = 1
        kwargs["input_features"] = torch.cat([features, pad_features])
        kwargs["feature_attention_mask"] = torch.cat([kept, pad_mask])


register(MediaFamily(("qwen3_omni_moe_thinker",), Qwen3OmniThinkerMedia))
