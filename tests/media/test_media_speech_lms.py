"""Speech LMs of the generic table (Granite Speech and Plus, Qwen3-ASR, Fun-ASR-Nano, Nemotron 3.5 Transcribe) key clips
by what their towers read.

A turn adding a clip and a changed clip are the family suite's cases (`tests/media/test_media_families.py`);
here, why each family's key holds: Qwen3-ASR's and Fun-ASR-Nano's towers give a clip the same
features however far a longer clip pads its row, so a clip keys by its valid chunks or frames and
still matches once re-padded; Granite Speech's conformer reads the padding, so its clips key with
it; and a Granite Speech model with a LoRA adapter (its generate turns the adapter on only for
calls passing audio) runs media cold, counted. Nemotron 3.5 Transcribe's placeholder id lies past its
text vocabulary, and its hybrid text layers make the hook prefill a turn's clip from embeddings (the
family suite's turn case). Every request runs cold and through the store: equal tokens, logits within 1e-4.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from conftest import Hits

from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.multimodal.generic import GenericMedia
from hf_prefix_cache.testing.media.harness import check, same_tokens_twice, served
from hf_prefix_cache.testing.media.speech_lms import (
    BUILDERS,
    GRANITE_WINDOW,
    Clip,
    media_kwargs,
    placeholders,
    tiny_granite_speech,
)
from hf_prefix_cache.testing.tiny_vlm_media import text
from hf_prefix_cache.testing.tiny_vlm_parts import _build


@pytest.mark.parametrize("name", list(BUILDERS))
def test_the_generic_adapter_serves_it(name: str) -> None:
    assert isinstance(media_adapter_for(BUILDERS[name]()), GenericMedia)


def _features(model: Any, clips: list[Clip]) -> torch.Tensor:
    kwargs = media_kwargs(clips)
    with torch.no_grad():
        return model.get_audio_features(kwargs["input_features"], kwargs["input_features_mask"]).pooler_output


@pytest.mark.parametrize("name", ["qwen3_asr", "fun_asr_nano"])
def test_a_clip_encodes_alike_alone_and_padded_by_a_longer_one(name: str) -> None:
    """The tower reads a clip's valid chunks (frames) only: its features ignore how far its row is padded."""
    model, short, long = BUILDERS[name](), Clip(name, 1), Clip(name, 2)
    assert long.frames > short.frames
    together = _features(model, [short, long])
    torch.testing.assert_close(together[: short.count], _features(model, [short]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen3_asr", "fun_asr_nano"])
def test_a_clip_repadded_by_a_longer_clip_before_it_still_matches(name: str) -> None:
    """A prompt holding the clip alone, then one whose longer clip comes first: the clip's span is reused."""
    model, clip, long = BUILDERS[name](), Clip(name, 1), Clip(name, 2)
    with served(model) as store:
        hits = Hits(store)
        head = text(5, 1)
        check(model, torch.cat([head, placeholders(clip), text(6, 2)], dim=1), store, media_kwargs([clip]))
        both = torch.cat([head, placeholders(clip), text(6, 2), placeholders(long), text(3, 3)], dim=1)
        check(model, both, store, media_kwargs([clip, long]))
        assert hits.last() == head.shape[1] + clip.count + 2 + 6  # through the clip's framing and the text after


@pytest.mark.parametrize("name", ["granite_speech", "granite_speech_plus"])
def test_a_granite_clip_reads_its_padding(name: str) -> None:
    """Padded to a longer clip's frames, a clip's features change: so its key is its whole padded row."""
    model, clip = BUILDERS[name](), Clip(name, 1)
    padded = media_kwargs([clip])
    rows = torch.zeros(1, clip.frames + 2 * GRANITE_WINDOW, padded["input_features"].shape[-1])
    rows[:, : clip.frames] = padded["input_features"]
    mask = torch.zeros(1, clip.count + 4, dtype=torch.bool)
    mask[:, : clip.count] = True
    with torch.no_grad():
        alone = model.get_audio_features(padded["input_features"]).pooler_output[padded["input_features_mask"]]
        longer = model.get_audio_features(rows).pooler_output[mask]
    assert (alone - longer).abs().max() > 1e-4


def test_granite_speech_with_a_lora_adapter_runs_media_cold() -> None:
    """Its generate turns the adapter on only for calls passing audio: a hit whose suffix has no clip would run
    without it, so such models keep no media adapter (`media_inputs:granite_speech`); their text is served."""
    config = tiny_granite_speech().config.to_dict()
    config["has_lora_adapter"] = True
    model = _build(transformers.GraniteSpeechForConditionalGeneration, transformers.GraniteSpeechConfig(**config))
    assert media_adapter_for(model) is None
    clip = Clip("granite_speech", 1)
    ids = torch.cat([text(5, 1), placeholders(clip), text(6, 2)], dim=1)
    with served(model, clean=False) as store:
        hits = Hits(store)
        same_tokens_twice(model, ids, store, **media_kwargs([clip]))
        assert hits.last() == 0
        assert store.stats().fallbacks == {"media_inputs:granite_speech": 2}


def test_nemotron_transcribe_placeholders_lie_past_the_text_vocabulary() -> None:
    """As NVIDIA's tokenizer appends it: the suffix embeddings must not look the placeholder id up as text."""
    model = BUILDERS["nemo_speechlm"]()
    clip = Clip("nemo_speechlm", 2)
    assert model.config.audio_token_id >= model.config.text_config.vocab_size
    with served(model) as store:
        hits = Hits(store)
        head = torch.cat([text(5, 1), text(6, 2)], dim=1)
        answer = check(model, head, store, {}).sequences
        turn = torch.cat([answer, placeholders(clip), text(3, 3)], dim=1)
        check(model, turn, store, media_kwargs([clip]))  # the clip lies in the suffix: prefilled from embeddings
        assert hits.last() == answer.shape[1] - 1
