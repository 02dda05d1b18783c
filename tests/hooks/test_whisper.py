"""Whisper short-form generation through the store: keyed by the audio, exact, the encoder skipped on a hit."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing import compare
from hf_prefix_cache.testing.compare import assert_same_outputs
from hf_prefix_cache.testing.encoder_decoder import decoder_reuse, next_request

SOT, EN, FR, TRANSCRIBE, TRANSLATE, NO_TIMESTAMPS, PREV = 100, 101, 102, 103, 104, 105, 106
#: Mel frames of one window: 2 stride-2 convolutions over 16 encoder positions.
FRAMES = 32


def tiny_whisper(d_model: int = 32, encoder_layers: int = 2) -> Any:
    """A random-weight multilingual Whisper (16 encoder positions, vocab 120) whose generation never stops early."""
    torch.manual_seed(0)
    config = transformers.WhisperConfig(
        vocab_size=120,
        d_model=d_model,
        encoder_layers=encoder_layers,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=2 * d_model,
        decoder_ffn_dim=2 * d_model,
        num_mel_bins=80,
        max_source_positions=FRAMES // 2,
        max_target_positions=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=SOT,
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )
    config._attn_implementation = "eager"
    model = transformers.WhisperForConditionalGeneration(config).eval()
    gen = model.generation_config
    gen.eos_token_id = None
    gen.max_length = None
    gen.do_sample = False
    gen.lang_to_id = {"<|en|>": EN, "<|fr|>": FR}
    gen.task_to_id = {"transcribe": TRANSCRIBE, "translate": TRANSLATE}
    gen.no_timestamps_token_id = NO_TIMESTAMPS
    gen.prev_sot_token_id = PREV
    gen.is_multilingual = True
    return model


@functools.cache
def whisper() -> Any:
    return tiny_whisper()


def audio(seed: int, frames: int = FRAMES, batch: int = 1) -> torch.Tensor:
    """Log-mel-like features `[batch, 80, frames]` depending only on `seed`."""
    return torch.randn(batch, 80, frames, generator=torch.Generator().manual_seed(seed))


def transcribe(model: Any, features: torch.Tensor | None, new: int = 6, **kwargs: Any) -> Any:
    """Greedy Whisper generation returning the whole decoder sequence and per-step logits."""
    return model.generate(
        features, max_new_tokens=new, return_dict_in_generate=True, output_logits=True, do_sample=False, **kwargs
    )


def same_as_cold(model: Any, store: PrefixCache, features: torch.Tensor, **kwargs: Any) -> float:
    """Run cold and through `store`; assert equal tokens; return the largest logit difference (asserted small)."""
    cold = transcribe(model, features, **kwargs)
    return assert_same_outputs(cold, transcribe(model, features, past_key_values=store, **kwargs))


@contextmanager
def encoder_calls(model: Any) -> Iterator[list[int]]:
    """Count forwards of the audio encoder while the block runs."""
    calls: list[int] = []
    handle = model.model.encoder.register_forward_hook(lambda *_: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


attached = functools.partial(compare.served, clean=False)


def served(store: PrefixCache, model: Any, features: torch.Tensor, **kwargs: Any) -> int:
    """Encoder forwards of one generate through `store`, checked against a cold run."""
    with encoder_calls(model) as calls:
        warm = transcribe(model, features, past_key_values=store, **kwargs)
    assert_same_outputs(transcribe(model, features, **kwargs), warm)
    return len(calls)


# ------------------------------------------------------------------------------------------- reuse


@pytest.mark.parametrize(
    "kwargs",
    [
        {"language": "en", "task": "transcribe"},
        {"language": "fr", "task": "translate"},
        {},  # no language: Whisper detects it from the encoder output
    ],
    ids=["en-transcribe", "fr-translate", "detect-language"],
)
def test_exact_repeat_reuses_the_decoder_prefix_and_skips_the_encoder(kwargs: dict[str, Any]) -> None:
    """The same clip again restores all but the last decoder prompt token, runs no encoder, and equals a cold run."""
    model = whisper()
    features = audio(1)
    with attached(model) as store:
        assert served(store, model, features, **kwargs) == 1
        assert store.stats().hit_tokens == 0
        assert served(store, model, features, **kwargs) == 0
        stats = store.stats()
        assert stats.hit_tokens == len(transcribe(model, features, new=1, **kwargs).sequences[0]) - 2
        assert stats.hit_tokens > 0 and stats.encoder_hits == 1 and stats.fallbacks == {}
        same_as_cold(model, store, features, **kwargs)


def test_cold_language_detection_runs_the_encoder_twice_the_store_once() -> None:
    """Without a language, a cold run encodes the clip for detection and again for decoding; the store encodes once."""
    model = whisper()
    with encoder_calls(model) as calls:
        transcribe(model, audio(2))
    assert len(calls) == 2
    with attached(model) as store:
        assert served(store, model, audio(2)) == 1


def test_another_audio_with_the_same_decoder_prompt_reuses_nothing() -> None:
    """Decoder states attend to the audio: a different clip with identical decoder ids gets no hit and is exact."""
    model = whisper()
    with attached(model) as store:
        same_as_cold(model, store, audio(3), language="en")
        store.reset_stats()
        with encoder_calls(model) as calls:
            same_as_cold(model, store, audio(4), language="en")
        assert store.stats().hit_tokens == 0
        assert len(calls) == 2  # the cold reference run and the store's own encoding
        assert store.stats().entries == 2


def test_same_audio_with_a_longer_prompt_reuses_the_shared_decoder_prefix() -> None:
    """`prompt_ids` extended by two tokens reuse the stored prompt part (a partial hit) and stay exact."""
    model = whisper()
    features = audio(5)
    short, longer = torch.tensor([PREV, 7, 8, 9]), torch.tensor([PREV, 7, 8, 9, 10, 11])
    with attached(model) as store:
        same_as_cold(model, store, features, language="en", prompt_ids=short)
        store.reset_stats()
        assert served(store, model, features, language="en", prompt_ids=longer) == 0
        assert store.stats().hit_tokens == len(short)


def test_explicit_decoder_input_ids_are_the_prompt() -> None:
    """`decoder_input_ids` given by the caller are matched and extended like Whisper's own prompt."""
    model = whisper()
    features = audio(6)
    with attached(model) as store:
        ids = torch.tensor([[SOT, EN, TRANSCRIBE, NO_TIMESTAMPS, 12, 13]])
        same_as_cold(model, store, features, decoder_input_ids=ids)
        store.reset_stats()
        same_as_cold(model, store, features, decoder_input_ids=ids)
        assert store.stats().hit_tokens == ids.shape[1] - 1


def test_a_full_decoder_attention_mask_is_served_and_one_with_zeros_runs_cold() -> None:
    """With `decoder_input_ids`, an all-ones `decoder_attention_mask` is served; a mask with a zero is `padding`."""
    model = whisper()
    features = audio(16)
    ids = torch.tensor([[SOT, EN, TRANSCRIBE, NO_TIMESTAMPS, 12, 13]])
    ones = torch.ones_like(ids)
    holed = ones.clone()
    holed[0, 4] = 0
    with attached(model) as store:
        for _ in range(2):
            same_as_cold(model, store, features, decoder_input_ids=ids, decoder_attention_mask=ones)
        assert store.stats().hit_tokens == ids.shape[1] - 1
        store.reset_stats()
        same_as_cold(model, store, features, decoder_input_ids=ids, decoder_attention_mask=holed)
        assert store.stats().fallbacks == {"padding": 1} and store.stats().hit_tokens == 0


def test_a_whole_answer_is_reused_as_the_next_prompt() -> None:
    """A prompt that continues a stored answer restores all of it that was fed (all but its last token)."""
    model = whisper()
    features = audio(7)
    with attached(model) as store:
        first = transcribe(model, features, past_key_values=store, language="en")
        store.reset_stats()
        ids = torch.cat([first.sequences, torch.tensor([[14, 15]])], dim=1)
        same_as_cold(model, store, features, decoder_input_ids=ids)
        assert store.stats().hit_tokens == first.sequences.shape[1] - 1


def test_a_feature_mask_is_part_of_the_key_and_served() -> None:
    """With an `attention_mask` for the features the prefix is still fed only once; another mask is another key."""
    model = whisper()
    features = audio(8)
    full, part = torch.ones(1, FRAMES, dtype=torch.long), torch.ones(1, FRAMES, dtype=torch.long)
    part[:, 20:] = 0
    with attached(model) as store:
        same_as_cold(model, store, features, language="en", attention_mask=full)
        same_as_cold(model, store, features, language="en", attention_mask=full)
        assert store.stats().hit_tokens == 3
        store.reset_stats()
        assert served(store, model, features, language="en", attention_mask=part) == 1
        assert store.stats().hit_tokens == 0


def test_a_clip_shorter_than_the_window_is_padded_as_whisper_pads_it() -> None:
    """Features shorter than the window are zero-padded before the encoder, as `generate` does, and stay exact."""
    model = whisper()
    with attached(model) as store:
        for _ in range(2):
            same_as_cold(model, store, audio(9, frames=FRAMES - 10), language="en")
        assert store.stats().hit_tokens == 3


def test_segments_of_a_full_window_clip_are_served() -> None:
    """`return_segments` (what the ASR pipeline asks for `return_language`) on a full-window clip equals a cold run."""
    model = whisper()
    with attached(model) as store:
        cold = model.generate(audio(15), max_new_tokens=4, language="en", return_segments=True)
        for _ in range(2):
            warm = model.generate(
                audio(15), max_new_tokens=4, language="en", return_segments=True, past_key_values=store
            )
            assert torch.equal(warm["sequences"], cold["sequences"])
            (got,), (want,) = warm["segments"], cold["segments"]
            assert [(s["start"], s["end"]) for s in got] == [(s["start"], s["end"]) for s in want]
            assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(got, want, strict=True))
        assert store.stats().hit_tokens == 3 and store.stats().fallbacks == {}


def test_sessions_keep_serving() -> None:
    """A session passed as `past_key_values` is served like the store and pins its entry."""
    model = whisper()
    with attached(model) as store:
        session = store.session("call-1")
        transcribe(model, audio(10), past_key_values=session, language="en")
        out = transcribe(model, audio(10), past_key_values=session, language="en")
        assert store.stats().hit_tokens == 3
        assert torch.equal(out.sequences, transcribe(model, audio(10), language="en").sequences)
        session.close()


def test_decoder_states_saved_to_disk_are_found_by_a_new_store(tmp_path: Path) -> None:
    """A new store on the same disk folder restores the clip's decoder prefix; encoder outputs are not persisted."""
    model = whisper()
    with attached(model, disk_dir=tmp_path, save_on_exit=False) as store:
        transcribe(model, audio(17), past_key_values=store, language="en")
        assert store.save() > 0
    with attached(model, disk_dir=tmp_path, save_on_exit=False) as store:
        assert served(store, model, audio(17), language="en") == 1
        assert store.stats().hit_tokens == 3 and store.stats().reloads == 1
        store.reset_stats()
        assert served(store, model, audio(18), language="en") == 1
        assert store.stats().hit_tokens == 0
        store.check_integrity()


# ------------------------------------------------------------------------- beams and several sequences

#: Whisper samples when its temperature is above 0; timestamp ids suppressed, so no row loops into a second window.
EXPANDED = {
    "beams": {"num_beams": 3},
    "beams-and-sequences": {"num_beams": 3, "num_return_sequences": 2},
    "samples": {"temperature": 0.8, "do_sample": True, "num_return_sequences": 3},
}


def _expanded(model: Any, store: PrefixCache | None, features: torch.Tensor, mode: str) -> Any:
    kwargs = {"past_key_values": store} if store is not None else {}
    torch.manual_seed(0)
    return model.generate(
        features,
        max_new_tokens=6,
        return_dict_in_generate=True,
        output_logits=True,
        language="en",
        suppress_tokens=list(range(NO_TIMESTAMPS + 1, 120)),
        **EXPANDED[mode],
        **kwargs,
    )


@pytest.mark.parametrize("mode", sorted(EXPANDED))
def test_beams_and_samples_reuse_the_encoder_output_and_decoder_prefix(mode: str) -> None:
    """Beams and several sampled sequences equal the cold call: the stored encoder output replaces the encoder, the
    decoder prompt is restored into every row, and the prompt (beams) or each sampled sequence is stored."""
    model, features = whisper(), audio(31)
    with attached(model) as store:
        transcribe(model, features, past_key_values=store, language="en")  # stores the audio and its decoder prompt
        entries = store.stats().entries
        cold = _expanded(model, None, features, mode)
        with encoder_calls(model) as calls:
            warm = _expanded(model, store, features, mode)
        assert torch.equal(cold.sequences, warm.sequences), f"tokens differ:\n{cold.sequences}\n{warm.sequences}"
        diff = max((a - b).abs().max().item() for a, b in zip(cold.logits, warm.logits, strict=True))
        assert diff < compare.LOGIT_TOL
        assert not calls, "the stored encoder output should replace the encoder"
        stats = store.stats()
        assert stats.hit_tokens == 3 and not stats.fallbacks  # start, language, task: all but the last prompt token
        if mode == "samples":
            distinct = {tuple(row.tolist()) for row in warm.sequences}
            assert len(distinct) > 1, "the samples should differ for this test"
            assert stats.entries == entries + len(distinct)  # each sampled sequence is its own entry
        else:
            assert stats.entries == entries  # the prompt once: a prefix of what the first call stored
        store.check_integrity()


def test_samples_that_loop_into_a_second_window_rerun_cold_drawing_what_a_cold_call_draws() -> None:
    """Sampled rows that decode timestamps loop into another window: the call reruns cold (`whisper_segments`),
    from the random state it started with, so its samples equal the cold call's."""
    model, features = whisper(), audio(31)
    with attached(model) as store:
        kwargs = {"temperature": 0.8, "do_sample": True, "num_return_sequences": 3, "language": "en"}
        torch.manual_seed(0)
        cold = model.generate(features, max_new_tokens=6, **kwargs)
        torch.manual_seed(0)
        warm = model.generate(features, max_new_tokens=6, past_key_values=store, **kwargs)
        assert torch.equal(cold, warm)
        assert store.stats().fallbacks == {"whisper_segments": 1}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"language": "en"},
        {"task": "transcribe"},  # each clip's language detected from its own encoder output
        {"language": "en", "num_beams": 2},
        {"language": "en", "temperature": 0.8, "do_sample": True, "num_return_sequences": 2},
    ],
    ids=["en", "detect-language", "beams", "samples"],
)
def test_a_batch_of_clips_serves_each_under_its_own(kwargs: dict[str, Any]) -> None:
    """Each clip of a batch is keyed by its own audio: a repeat skips the encoder and restores every clip's decoder
    prompt, equal to the cold call; a clip alone then hits what the batch stored for it."""
    model = whisper()
    features = torch.cat([audio(71), audio(72)])
    with attached(model) as store:
        plain = {key: value for key, value in kwargs.items() if key in ("language", "task")}
        transcribe(model, features, past_key_values=store, **plain)  # stores both clips and their prompts
        assert store.stats().entries == 2 and store.stats().encoder_entries == 2
        outputs = {"max_new_tokens": 3, "return_dict_in_generate": True, "output_logits": True}
        torch.manual_seed(0)
        cold = model.generate(features, **outputs, **kwargs)
        torch.manual_seed(0)
        with encoder_calls(model) as calls:
            warm = model.generate(features, past_key_values=store, **outputs, **kwargs)
        assert_same_outputs(cold, warm)
        assert not calls, "the stored encoder outputs should replace the encoder"
        stats = store.stats()
        assert stats.hit_tokens == 2 * 3 and not stats.fallbacks  # start, language, task of each clip
        same_as_cold(model, store, audio(72), **plain)
        assert store.stats().hit_tokens == 3 * 3 and store.stats().encoder_hits == 3
        store.check_integrity()


# ------------------------------------------------------------------------------- encoder outputs


def test_encoder_outputs_are_bounded_least_recently_used_first() -> None:
    """With room for one output, a second clip replaces the first, which is encoded again when it returns."""
    model = whisper()
    one = 1 * (FRAMES // 2) * model.config.d_model * 4  # [1, positions, d_model] float32
    with attached(model, max_encoder_bytes=one) as store:
        assert served(store, model, audio(11), language="en") == 1
        assert store.stats().encoder_nbytes == one and store.stats().encoder_entries == 1
        assert served(store, model, audio(12), language="en") == 1
        assert store.stats().encoder_nbytes == one and store.stats().encoder_entries == 1
        assert served(store, model, audio(12), language="en") == 0
        assert served(store, model, audio(11), language="en") == 1
        assert store.stats().hit_tokens == 3 + 3  # decoder states are kept by the tree regardless
        store.clear()
        assert store.stats().encoder_entries == 0 and store.stats().encoder_nbytes == 0


def test_a_zero_encoder_budget_keeps_no_outputs_but_still_reuses_decoder_states() -> None:
    """`max_encoder_bytes=0`: the encoder runs on every request, the decoder prefix is still restored, exactly."""
    model = whisper()
    with attached(model, max_encoder_bytes=0) as store:
        assert served(store, model, audio(13), language="en") == 1
        assert served(store, model, audio(13), language="en") == 1
        assert store.stats().hit_tokens == 3 and store.stats().encoder_nbytes == 0


def test_the_default_encoder_budget_is_an_eighth_of_the_device_budget() -> None:
    """Without `max_encoder_bytes` the encoder outputs get an eighth of `max_bytes`."""
    with attached(whisper(), max_bytes="8MB") as store:
        assert store.stats().max_encoder_bytes == 1_000_000


# ------------------------------------------------------------------------------------- fallbacks


@pytest.mark.parametrize(
    ("features", "kwargs", "reason"),
    [
        (audio(20, frames=2 * FRAMES), {}, "long_form"),
        (audio(22), {"language": "en", "return_timestamps": True}, "return_timestamps"),
        (audio(23), {"language": "en", "temperature": (0.0, 0.2)}, "temperature_fallback"),
        (audio(24), {"language": "en", "use_cache": False}, "use_cache_false"),
        (audio(25, frames=FRAMES - 4), {"language": "en", "return_segments": True}, "return_segments"),
        (audio(26), {"language": "en", "cache_implementation": "dynamic"}, "cache_implementation:dynamic"),
    ],
    ids=["long-form", "timestamps", "temperature-fallback", "no-cache", "segments", "cache-implementation"],
)
def test_what_the_store_does_not_serve_runs_cold_with_a_reason(
    features: torch.Tensor, kwargs: dict[str, Any], reason: str
) -> None:
    """Long-form audio, timestamps, temperature fallback, use_cache=False, a cache_implementation and segments of a
    clip shorter than the window run Whisper's own generate."""
    model = whisper()
    with attached(model) as store:
        for _ in range(2):
            with encoder_calls(model) as calls:
                warm = model.generate(features, max_new_tokens=4, past_key_values=store, **kwargs)
            cold = model.generate(features, max_new_tokens=4, **kwargs)
            assert len(calls) >= 1  # Whisper's own path encodes the audio itself
            got, want = (warm, cold) if isinstance(cold, torch.Tensor) else (warm["sequences"], cold["sequences"])
            assert torch.equal(got, want)
        stats = store.stats()
        assert stats.fallbacks == {reason: 2}
        assert stats.hit_tokens == 0 and stats.entries == 0 and stats.encoder_entries == 0


def test_a_subclass_of_whisper_is_not_served() -> None:
    """Only the exact Whisper class is served; a subclass may change generate and runs cold."""

    class CustomWhisper(transformers.WhisperForConditionalGeneration):  # type: ignore[misc]
        pass

    model = CustomWhisper(whisper().config).eval()
    with attached(model) as store:
        assert store._store.profile.unsupported == "encoder_decoder"


def test_low_level_api_refuses_whisper() -> None:
    """`lookup`, `insert` and `pin` key token ids only, which cannot tell two clips apart."""
    store = PrefixCache(whisper(), attach=False)
    ids = torch.tensor([[SOT, EN, TRANSCRIBE]])
    with pytest.raises(ValueError, match="encoder-decoder"):
        store.lookup(ids)
    with pytest.raises(ValueError, match="encoder-decoder"):
        store.insert(ids, store._store.new_cache())
    with pytest.raises(ValueError, match="encoder-decoder"):
        store.pin(ids)


def test_detach_restores_both_generate_methods() -> None:
    """After `detach` the model's `generate` and `generate_with_fallback` are the class's own again."""
    model = tiny_whisper()
    store = PrefixCache(model)
    assert "generate_with_fallback" in model.__dict__
    store.detach()
    assert "generate" not in model.__dict__ and "generate_with_fallback" not in model.__dict__


def test_two_stores_on_one_model_each_serve_their_own_requests() -> None:
    """Stacked hooks of two stores pass each other's requests through: each store holds only what went through it."""
    model = whisper()
    with attached(model) as first, attached(model, max_encoder_bytes=0) as second:
        same_as_cold(model, first, audio(30), language="en")
        same_as_cold(model, second, audio(31), language="en")
        same_as_cold(model, first, audio(30), language="en")
        same_as_cold(model, second, audio(30), language="en")
        assert first.stats().hit_tokens == 3 and first.stats().entries == 1
        assert second.stats().hit_tokens == 0 and second.stats().entries == 2
        assert first.stats().encoder_entries == 1 and second.stats().encoder_entries == 0


# ------------------------------------------------------------------------------ random requests

_whisper_requests = st.lists(
    st.tuples(st.integers(0, 2), st.lists(st.integers(10, 13), max_size=6), st.booleans()), min_size=1, max_size=4
)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=_whisper_requests)
def test_random_requests_reuse_exactly_what_the_rules_allow(requests: list[Any]) -> None:
    """Random (clip, decoder ids) requests, some continuing the previous answer, equal cold runs and
    reuse exactly the longest decoder prefix stored for the same clip."""
    model = whisper()
    stored: list[tuple[int, list[int]]] = []
    previous: tuple[int, list[int]] | None = None
    with attached(model) as store:
        for drawn, tail, continues in requests:
            clip, prompt = next_request(previous, drawn, tail, continues, [SOT, EN, TRANSCRIBE, NO_TIMESTAMPS])
            before = store.stats().hit_tokens
            warm = transcribe(model, audio(100 + clip), decoder_input_ids=torch.tensor([prompt]), past_key_values=store)
            assert_same_outputs(transcribe(model, audio(100 + clip), decoder_input_ids=torch.tensor([prompt])), warm)
            if store.stats().fallbacks:  # Whisper looped into a second segment: rerun cold, with a first
                assert store.stats().fallbacks == {"whisper_segments": 1}  # segment stored that no rule models
                assert store.stats().hit_tokens == before
                return
            assert store.stats().hit_tokens - before == decoder_reuse(stored, clip, prompt)
            sequence = warm.sequences[0].tolist()
            stored.append((clip, sequence[:-1]))
            previous = (clip, sequence)
        assert not store.stats().fallbacks, store.stats().fallbacks
        store.check_integrity()


def test_a_request_that_loops_into_a_second_segment_reruns_cold() -> None:
    """When Whisper loops into a second segment (whose encoder input is a later window, not the stored encoder
    output), the request reruns cold and equals its cold run: found by the property test, which raised, and
    then 1.3e-3 off when only the second segment ran without the cache."""
    model = whisper()
    with attached(model) as store:
        first = [SOT, EN, TRANSCRIBE, NO_TIMESTAMPS, 10, 10, 10, 10]
        warm = transcribe(model, audio(100), decoder_input_ids=torch.tensor([first]), past_key_values=store)
        prompt = warm.sequences[0].tolist() + [10, 10, 10, 10, 10, 11]
        before = store.stats().hit_tokens
        warm = transcribe(model, audio(100), decoder_input_ids=torch.tensor([prompt]), past_key_values=store)
        assert_same_outputs(transcribe(model, audio(100), decoder_input_ids=torch.tensor([prompt])), warm)
        assert store.stats().hit_tokens == before
        assert store.stats().fallbacks == {"whisper_segments": 1}
        store.check_integrity()
