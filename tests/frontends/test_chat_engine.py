"""ChatEngine, the engine of the Gradio app: audio and image turns equal cold runs and report what they reused; WAV decoding."""

from __future__ import annotations

import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from hf_prefix_cache.frontends.chat import ChatEngine, read_wav
from hf_prefix_cache.frontends.tiny_vlm import load_tiny_audio_lm


def _write_wav(path: Path, samples: np.ndarray, rate: int, channels: int = 1, width: int = 2) -> Path:
    with wave.open(str(path), "wb") as f:
        f.setnchannels(channels)
        f.setsampwidth(width)
        f.setframerate(rate)
        f.writeframes(samples.tobytes())
    return path


@pytest.fixture(scope="module")
def audio_engine() -> Any:
    model, processor = load_tiny_audio_lm()
    engine = ChatEngine(model, processor, max_new_tokens=5)
    yield engine
    engine.store.detach()


def test_an_audio_turn_is_reused_by_the_next_turn_and_equals_cold(audio_engine: ChatEngine, tmp_path: Path) -> None:
    """A WAV clip's 25 placeholders come back from the store on the next turn, and both answers equal cold runs."""
    t = np.arange(16000) / 16000
    clip = _write_wav(tmp_path / "tone.wav", (np.sin(2 * np.pi * 440 * t) * 20000).astype(np.int16), 16000)
    image = tmp_path / "photo.png"
    Image.new("RGB", (8, 8)).save(image)
    chat = audio_engine.new_conversation("audio")
    *_, (_, first) = audio_engine.turn(chat, "What is this sound?", [str(clip), str(image)], compare_cold=True)
    *_, (_, second) = audio_engine.turn(chat, "Louder?", compare_cold=True)
    assert first.same_as_cold and second.same_as_cold
    assert first.reused_len == 0 and first.notes == (
        "Qwen2AudioForConditionalGeneration takes no images: photo.png ignored",
    )
    assert second.reused_by_modality["audio"] == 25
    assert second.reused_len == sum(second.reused_by_modality.values()) > first.prompt_len - 1
    assert second.fallback is None and second.tier_nbytes["device"] > 0


def test_read_wav_scales_mixes_and_resamples(tmp_path: Path) -> None:
    """16-bit samples scale to [-1, 1], stereo is averaged to mono, 8 kHz doubles in length at 16 kHz; 24-bit is refused by name."""
    samples = np.array([0, 16384, -16384, 32767], dtype=np.int16)
    same = read_wav(str(_write_wav(tmp_path / "a.wav", samples, 16000)), 16000)
    np.testing.assert_allclose(same, samples / 32768.0)
    stereo = np.array([[0, 16384], [16384, 16384]], dtype=np.int16)
    np.testing.assert_allclose(
        read_wav(str(_write_wav(tmp_path / "b.wav", stereo, 16000, channels=2)), 16000), [0.25, 0.5]
    )
    slow = read_wav(str(_write_wav(tmp_path / "c.wav", np.zeros(800, dtype=np.int16), 8000)), 16000)
    assert slow.shape == (1600,) and slow.dtype == np.float32
    wide = _write_wav(tmp_path / "d.wav", np.zeros(30, dtype=np.uint8), 16000, width=3)
    with pytest.raises(ValueError, match="24-bit WAV is not supported"):
        read_wav(str(wide), 16000)
