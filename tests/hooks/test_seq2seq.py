"""Encoder-decoder models on `GenerationMixin.generate` (BART, T5, mT5, Marian, Pegasus, Florence-2) through the store.

Keyed by the encoder input: exact against cold runs (tokens, logits < 1e-4), the encoder skipped
when its input was seen, decoder prefixes reused only under the same encoder input.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.compare import assert_same_outputs, served
from hf_prefix_cache.testing.encoder_decoder import decoder_reuse, next_request

VOCAB = 100
IMAGE = 99  # Florence-2's image placeholder id
#: Florence-2 placeholders per 32x32 image: a 4x4 grid after strides 4 and 2, plus one temporal token.
IMAGE_TOKENS = 17


def _bart_sizes() -> dict[str, Any]:
    return {
        "vocab_size": VOCAB,
        "d_model": 32,
        "encoder_layers": 3,  # unlike the decoder's, so a cache sized by the encoder would fail
        "decoder_layers": 2,
        "encoder_attention_heads": 4,
        "decoder_attention_heads": 4,
        "encoder_ffn_dim": 64,
        "decoder_ffn_dim": 64,
        "max_position_embeddings": 128,
        "pad_token_id": 1,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "decoder_start_token_id": 2,
        "init_std": 0.5,  # greedy tokens that depend on the input; logits below ~10
    }


def _t5_sizes() -> dict[str, Any]:
    return {
        "vocab_size": VOCAB,
        "d_model": 32,
        "d_kv": 8,
        "d_ff": 64,
        "num_layers": 3,
        "num_decoder_layers": 2,
        "num_heads": 4,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,
        "initializer_factor": 1.0,
    }


def _florence2() -> Any:
    return transformers.Florence2ForConditionalGeneration(
        transformers.Florence2Config(
            vision_config={
                "depths": [1, 1],
                "patch_size": [7, 3],
                "patch_stride": [4, 2],
                "patch_padding": [3, 1],
                "patch_prenorm": [False, True],
                "embed_dim": [16, 32],
                "num_heads": [2, 4],
                "num_groups": [2, 4],
                "window_size": 2,
                "drop_path_rate": 0.0,
                "projection_dim": 32,
                "max_temporal_embeddings": 4,
                "max_position_embeddings": 8,
            },
            text_config={"model_type": "bart", **_bart_sizes()},
            image_token_id=IMAGE,
        )
    )


BUILDERS: dict[str, Callable[[], Any]] = {
    "bart": lambda: transformers.BartForConditionalGeneration(transformers.BartConfig(**_bart_sizes())),
    "t5": lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(**_t5_sizes())),
    "mt5": lambda: transformers.MT5ForConditionalGeneration(transformers.MT5Config(**_t5_sizes())),
    "marian": lambda: transformers.MarianMTModel(
        transformers.MarianConfig(**{**_bart_sizes(), "decoder_start_token_id": 1, "decoder_vocab_size": VOCAB})
    ),
    "pegasus": lambda: transformers.PegasusForConditionalGeneration(transformers.PegasusConfig(**_bart_sizes())),
    "florence2": _florence2,
}
TEXT_FAMILIES = ["bart", "t5", "mt5", "marian", "pegasus"]


@functools.cache
def tiny(name: str) -> Any:
    """A random-weight model of family `name` (eager attention, greedy, never stopping at EOS)."""
    torch.manual_seed(0)
    model = BUILDERS[name]().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.forced_eos_token_id = None
    model.generation_config.do_sample = False
    return model


def encoder_input(name: str, seed: int, n: int = 12) -> dict[str, torch.Tensor]:
    """`generate` kwargs feeding the encoder: random ids (Florence-2: after an image's placeholders, with its pixels)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, IMAGE, (1, n), generator=g)
    if name != "florence2":
        return {"input_ids": ids}
    ids = torch.cat([torch.zeros(1, 1, dtype=torch.long), torch.full((1, IMAGE_TOKENS), IMAGE), ids], dim=1)
    return {"input_ids": ids, "pixel_values": torch.randn(1, 3, 32, 32, generator=g)}


def run(model: Any, inputs: dict[str, torch.Tensor], new: int = 5, **kwargs: Any) -> Any:
    return model.generate(
        **inputs, max_new_tokens=new, do_sample=False, return_dict_in_generate=True, output_logits=True, **kwargs
    )


def same_as_cold(model: Any, store: PrefixCache, inputs: dict[str, torch.Tensor], **kwargs: Any) -> Any:
    """Run through `store` and cold; assert equal tokens and logits within LOGIT_TOL; return the cached run."""
    warm = run(model, inputs, past_key_values=store, **kwargs)
    assert_same_outputs(run(model, inputs, **kwargs), warm)
    return warm


@contextmanager
def encoder_calls(model: Any) -> Iterator[list[int]]:
    """Count forwards of the (text) encoder while the block runs; Florence-2's vision tower must run with it."""
    calls: list[int] = []
    vision: list[int] = []
    handles = [model.get_encoder().register_forward_hook(lambda *_: calls.append(1))]
    tower = getattr(getattr(model, "model", None), "vision_tower", None)
    if tower is not None:
        handles.append(tower.register_forward_hook(lambda *_: vision.append(1)))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()
    assert tower is None or len(vision) == len(calls), f"vision tower ran {len(vision)}x, text encoder {len(calls)}x"


attached = functools.partial(served, clean=False)


def decoder_prompt(model: Any, *tail: int) -> torch.Tensor:
    """Decoder ids: the model's start token, then `tail`."""
    return torch.tensor([[model.generation_config.decoder_start_token_id, *tail]])


# ------------------------------------------------------------------------------------------- reuse


@pytest.mark.parametrize("name", [*TEXT_FAMILIES, "florence2"])
def test_an_exact_repeat_reuses_the_decoder_prefix_and_skips_the_encoder(name: str) -> None:
    """Repeating a request restores all decoder prompt tokens but the last, and the encoder does not run."""
    model = tiny(name)
    inputs = encoder_input(name, seed=1)
    prompt = decoder_prompt(model, 7, 8, 9)
    with attached(model) as store:
        assert store._store.profile.encoder_family == "seq2seq"
        with encoder_calls(model) as calls:
            same_as_cold(model, store, inputs, decoder_input_ids=prompt)
        assert len(calls) == 2  # the stored run and the cold one
        with encoder_calls(model) as calls:
            same_as_cold(model, store, inputs, decoder_input_ids=prompt)
        assert len(calls) == 1  # only the cold run
        stats = store.stats()
        assert stats.hit_tokens == prompt.shape[1] - 1
        assert stats.encoder_hits == 1 and stats.encoder_entries == 1
        assert stats.fallbacks == {}


@pytest.mark.parametrize("name", ["bart", "t5", "florence2"])
def test_the_default_decoder_prompt_reuses_the_encoder_output(name: str) -> None:
    """Without decoder ids the prompt is the start token alone: nothing to restore, but the encoder is skipped."""
    model = tiny(name)
    inputs = encoder_input(name, seed=2)
    with attached(model) as store:
        same_as_cold(model, store, inputs)
        with encoder_calls(model) as calls:
            same_as_cold(model, store, inputs)
        assert len(calls) == 1
        assert store.stats().encoder_hits == 1 and store.stats().hit_tokens == 0
        assert store.stats().entries == 1


@pytest.mark.parametrize("name", ["bart", "t5", "florence2"])
def test_another_encoder_input_with_the_same_decoder_prompt_reuses_nothing(name: str) -> None:
    """The same decoder ids over another encoder input restore nothing and encode the new input."""
    model = tiny(name)
    prompt = decoder_prompt(model, 7, 8, 9)
    with attached(model) as store:
        same_as_cold(model, store, encoder_input(name, seed=3), decoder_input_ids=prompt)
        with encoder_calls(model) as calls:
            same_as_cold(model, store, encoder_input(name, seed=4), decoder_input_ids=prompt)
        assert len(calls) == 2
        assert store.stats().hit_tokens == 0 and store.stats().encoder_hits == 0
        assert store.stats().entries == 2


def test_another_image_with_the_same_text_reuses_nothing() -> None:
    """Florence-2: the pixels are part of the encoder input; a new image with the same ids is a miss."""
    model = tiny("florence2")
    inputs = encoder_input("florence2", seed=5)
    other = {**inputs, "pixel_values": inputs["pixel_values"] + 0.5}
    prompt = decoder_prompt(model, 7, 8)
    with attached(model) as store:
        same_as_cold(model, store, inputs, decoder_input_ids=prompt)
        same_as_cold(model, store, other, decoder_input_ids=prompt)
        assert store.stats().hit_tokens == 0 and store.stats().encoder_hits == 0


@pytest.mark.parametrize("name", ["bart", "t5", "florence2"])
def test_a_decoder_prompt_continuing_a_stored_answer_reuses_it(name: str) -> None:
    """Decoder ids extending a stored answer restore that answer (all but its last token, never fed)."""
    model = tiny(name)
    inputs = encoder_input(name, seed=6)
    with attached(model) as store:
        first = same_as_cold(model, store, inputs, decoder_input_ids=decoder_prompt(model, 7))
        answer = first.sequences  # start, 7, then 5 generated tokens
        same_as_cold(model, store, inputs, decoder_input_ids=torch.cat([answer, torch.tensor([[11, 12]])], dim=1))
        assert store.stats().hit_tokens == answer.shape[1] - 1


def test_decoder_ids_without_the_start_token_get_it_as_generate_prepends_it() -> None:
    """Decoder ids lacking the start token are keyed as generate feeds them: with the start token first."""
    model = tiny("bart")
    inputs = encoder_input("bart", seed=7)
    with attached(model) as store:
        same_as_cold(model, store, inputs, decoder_input_ids=torch.tensor([[7, 8, 9]]))
        same_as_cold(model, store, inputs, decoder_input_ids=decoder_prompt(model, 7, 8, 9))
        assert store.stats().hit_tokens == 3


def test_a_padded_encoder_mask_is_part_of_the_key_and_served() -> None:
    """An encoder attention mask with zeros is hashed with the ids: the same mask is served exactly, another misses."""
    model = tiny("bart")
    inputs = encoder_input("bart", seed=8)
    padded = torch.ones_like(inputs["input_ids"])
    padded[:, -3:] = 0
    prompt = decoder_prompt(model, 7, 8)
    with attached(model) as store:
        same_as_cold(model, store, {**inputs, "attention_mask": padded}, decoder_input_ids=prompt)
        with encoder_calls(model) as calls:
            same_as_cold(model, store, {**inputs, "attention_mask": padded}, decoder_input_ids=prompt)
        assert len(calls) == 1 and store.stats().hit_tokens == 2
        same_as_cold(model, store, {**inputs, "attention_mask": torch.ones_like(padded)}, decoder_input_ids=prompt)
        same_as_cold(model, store, inputs, decoder_input_ids=prompt)  # no mask: another key again
        assert store.stats().hit_tokens == 2 and store.stats().encoder_entries == 3


def test_a_full_decoder_attention_mask_is_served_and_one_with_zeros_runs_cold() -> None:
    """A decoder mask of ones is what the hook passes anyway; one with zeros runs cold as `padding`."""
    model = tiny("bart")
    inputs = encoder_input("bart", seed=9)
    prompt = decoder_prompt(model, 7, 8, 9)
    with attached(model) as store:
        same_as_cold(model, store, inputs, decoder_input_ids=prompt, decoder_attention_mask=torch.ones_like(prompt))
        same_as_cold(model, store, inputs, decoder_input_ids=prompt, decoder_attention_mask=torch.ones_like(prompt))
        assert store.stats().hit_tokens == 3
        holes = torch.tensor([[1, 0, 1, 1]])
        same_as_cold(model, store, inputs, decoder_input_ids=prompt, decoder_attention_mask=holes)
        assert store.stats().fallbacks == {"padding": 1}


def test_sessions_keep_serving() -> None:
    """A session's turns are stored and reused like plain requests."""
    model = tiny("t5")
    inputs = encoder_input("t5", seed=10)
    with attached(model) as store:
        session = store.session("chat")
        prompt = decoder_prompt(model, 7)
        for _ in range(3):
            out = run(model, inputs, decoder_input_ids=prompt, past_key_values=session)
            cold = run(model, inputs, decoder_input_ids=prompt)
            assert_same_outputs(cold, out)
            prompt = torch.cat([out.sequences, torch.tensor([[11]])], dim=1)  # the next turn continues the answer
        # Turns 2 and 3 restore the previous turn's whole sequence but its last token.
        assert store.stats().hit_tokens == (1 + 5) + (1 + 5 + 1 + 5)


def test_decoder_states_saved_to_disk_are_found_by_a_new_store(tmp_path: Path) -> None:
    """A new store on the same disk folder restores the decoder prefix of the same input; encoder outputs are not saved."""
    model = tiny("t5")
    inputs = encoder_input("t5", seed=15)
    prompt = decoder_prompt(model, 7, 8, 9)
    with attached(model, disk_dir=tmp_path, save_on_exit=False) as store:
        run(model, inputs, decoder_input_ids=prompt, past_key_values=store)
        assert store.save() > 0
    with attached(model, disk_dir=tmp_path, save_on_exit=False) as store:
        with encoder_calls(model) as calls:
            same_as_cold(model, store, inputs, decoder_input_ids=prompt)
        assert len(calls) == 2  # the encoder output was not saved: it runs again
        assert store.stats().hit_tokens == 3 and store.stats().reloads == 1
        same_as_cold(model, store, encoder_input("t5", seed=16), decoder_input_ids=prompt)
        assert store.stats().hit_tokens == 3
        store.check_integrity()


# ------------------------------------------------------------------------------------------ decoding modes


@pytest.mark.parametrize("name", ["bart", "t5"])
@pytest.mark.parametrize(
    "mode",
    [{"num_beams": 3}, {"num_beams": 2, "num_return_sequences": 2}, {"do_sample": True, "num_return_sequences": 3}],
    ids=["beams", "two-of-two-beams", "samples"],
)
def test_beams_and_samples_reuse_the_encoder_output_and_the_decoder_prefix(name: str, mode: dict[str, Any]) -> None:
    """Beams and several samples equal the cold call, skip the encoder of a seen input and restore the decoder prefix
    into every row generate makes of it."""
    model = tiny(name)
    inputs = encoder_input(name, seed=21)
    prompt = decoder_prompt(model, 7, 8, 9, 10)
    kwargs = {**mode, "do_sample": mode.get("do_sample", False)}
    with attached(model) as store:
        run(model, inputs, decoder_input_ids=prompt[:, :4], past_key_values=store)  # stores the encoder output
        with encoder_calls(model) as calls:
            torch.manual_seed(0)
            warm = model.generate(**inputs, decoder_input_ids=prompt, max_new_tokens=4, past_key_values=store,
                                  return_dict_in_generate=True, output_logits=True, **kwargs)  # fmt: skip
        assert not calls, "the stored encoder output should replace the encoder"
        torch.manual_seed(0)
        cold = model.generate(**inputs, decoder_input_ids=prompt, max_new_tokens=4, return_dict_in_generate=True,
                              output_logits=True, **kwargs)  # fmt: skip
        assert_same_outputs(cold, warm)
        # The first call stored start + 3 ids + its answer; this prompt shares the start and 3 ids.
        assert store.stats().hit_tokens == 4
        assert store.stats().fallbacks == {}
        store.check_integrity()


# ------------------------------------------------------------------------------------------ fallbacks


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"use_cache": False}, "use_cache_false"),
        ({"output_attentions": True}, "output_attentions"),
        ({"cache_implementation": "static"}, "cache_implementation:static"),
        ({"head_mask": None, "labels": torch.tensor([[5, 6, 7]])}, "encoder_kwarg:labels"),  # None counts as absent
    ],
    ids=["no-cache", "attentions", "static-cache", "unknown-kwarg"],
)
def test_what_the_store_does_not_serve_runs_cold_with_a_reason(kwargs: dict[str, Any], reason: str) -> None:
    """No cache, attentions, another cache class and unknown model kwargs run cold (beams are served, below)."""
    model = tiny("bart")
    inputs = encoder_input("bart", seed=11)
    with attached(model) as store:
        for _ in range(2):
            try:
                warm = model.generate(**inputs, max_new_tokens=3, past_key_values=store, **kwargs)
            except (TypeError, ValueError) as err:  # the model refuses the kwarg itself, as it does cold
                with pytest.raises(type(err)):
                    model.generate(**inputs, max_new_tokens=3, **kwargs)
                continue
            if not kwargs.get("do_sample"):
                cold = model.generate(**inputs, max_new_tokens=3, **kwargs)
                got = warm if isinstance(warm, torch.Tensor) else warm.sequences
                assert torch.equal(got, cold if isinstance(cold, torch.Tensor) else cold.sequences)
        stats = store.stats()
        assert stats.fallbacks == {reason: 2}
        assert stats.entries == 0 and stats.encoder_entries == 0


def padded_batch(name: str, seeds: tuple[int, int], lengths: tuple[int, int] = (12, 9)) -> dict[str, torch.Tensor]:
    """Two rows of encoder input, the shorter one padded on the right with a mask of zeros (Florence-2: their images)."""
    rows = [encoder_input(name, seed, n) for seed, n in zip(seeds, lengths, strict=True)]
    width = max(row["input_ids"].shape[1] for row in rows)
    ids = torch.full((2, width), tiny("bart").config.pad_token_id)  # Florence-2 pads as its BART does
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, row in enumerate(rows):
        n = row["input_ids"].shape[1]
        ids[i, :n], mask[i, :n] = row["input_ids"][0], 1
    batch = {"input_ids": ids, "attention_mask": mask}
    if name == "florence2":
        batch["pixel_values"] = torch.cat([row["pixel_values"] for row in rows])
    return batch


@pytest.mark.parametrize("name", ["bart", "t5", "florence2"])
def test_a_batch_of_encoder_inputs_serves_each_row_under_its_own(name: str) -> None:
    """Each row of a batch is keyed by its own encoder input (padding included): a repeat skips the encoder and
    restores every row's decoder prefix, a row alone as it stood in the batch hits, the rows swapped hit."""
    model = tiny(name)
    batch = padded_batch(name, (51, 52))
    prompt = torch.cat([decoder_prompt(model, 7, 8, 9)] * 2)
    with attached(model) as store:
        same_as_cold(model, store, batch, decoder_input_ids=prompt)
        assert store.stats().entries == 2 and store.stats().encoder_entries == 2
        with encoder_calls(model) as calls:
            same_as_cold(model, store, batch, decoder_input_ids=prompt)
        assert len(calls) == 1  # only the cold run
        assert store.stats().hit_tokens == 2 * 3 and store.stats().encoder_hits == 2
        second = {key: value[1:] for key, value in batch.items()}
        same_as_cold(model, store, second, decoder_input_ids=prompt[:1])
        assert store.stats().hit_tokens == 2 * 3 + 3
        swapped = {key: value.flip(0) for key, value in batch.items()}
        same_as_cold(model, store, swapped, decoder_input_ids=prompt)
        assert store.stats().hit_tokens == 4 * 3 + 3 and store.stats().fallbacks == {}
        store.check_integrity()


def test_a_batch_restores_to_the_shortest_stored_prefix_of_its_rows() -> None:
    """Rows with stored prefixes of different lengths restore to the column every row reaches; the longer one counts
    as `batch_layout`; then each finished row is stored, and the repeat restores all but the last prompt token."""
    model = tiny("bart")
    batch = padded_batch("bart", (53, 54))
    long_prompt = decoder_prompt(model, 7, 8, 9, 10)
    with attached(model) as store:
        same_as_cold(model, store, {k: v[:1] for k, v in batch.items()}, decoder_input_ids=long_prompt)
        same_as_cold(model, store, {k: v[1:] for k, v in batch.items()}, decoder_input_ids=long_prompt[:, :3])
        before = store.stats().hit_tokens
        prompt = torch.cat([long_prompt] * 2)
        same_as_cold(model, store, batch, decoder_input_ids=prompt)
        assert store.stats().hit_tokens - before == 2 * 3  # row 1 stored its 3 prompt ids and answer: 3 of 4
        assert store.stats().fallbacks == {"batch_layout": 1}
        same_as_cold(model, store, batch, decoder_input_ids=prompt)
        assert store.stats().hit_tokens - before == 2 * 3 + 2 * 4
        store.check_integrity()


@pytest.mark.parametrize(
    "mode",
    [{"num_beams": 3}, {"num_beams": 2, "num_return_sequences": 2}, {"do_sample": True, "num_return_sequences": 3}],
    ids=["beams", "two-of-two-beams", "samples"],
)
def test_a_batch_with_beams_and_samples_equals_the_cold_call(mode: dict[str, Any]) -> None:
    """Beams and several samples of a batch: every row's prefix restored into each of its rows, equal to cold."""
    model = tiny("bart")
    batch = padded_batch("bart", (55, 56))
    prompt = torch.cat([decoder_prompt(model, 7, 8, 9)] * 2)
    kwargs = {**mode, "do_sample": mode.get("do_sample", False)}
    with attached(model) as store:
        run(model, batch, decoder_input_ids=prompt, past_key_values=store)
        torch.manual_seed(0)
        warm = model.generate(**batch, decoder_input_ids=prompt, max_new_tokens=4, past_key_values=store,
                              return_dict_in_generate=True, output_logits=True, **kwargs)  # fmt: skip
        torch.manual_seed(0)
        cold = model.generate(**batch, decoder_input_ids=prompt, max_new_tokens=4, return_dict_in_generate=True,
                              output_logits=True, **kwargs)  # fmt: skip
        assert_same_outputs(cold, warm)
        assert store.stats().hit_tokens == 2 * 3 and store.stats().fallbacks == {}
        store.check_integrity()


def test_a_batch_with_decoder_rows_of_another_count_runs_cold() -> None:
    """Decoder ids whose rows do not match the encoder rows run cold as `batch_size`."""
    model = tiny("bart")
    batch = padded_batch("bart", (57, 58))
    with attached(model) as store:
        try:
            warm = run(model, batch, decoder_input_ids=decoder_prompt(model, 7), past_key_values=store)
        except (ValueError, RuntimeError) as err:  # transformers refuses it itself, as it does cold
            with pytest.raises(type(err)):
                run(model, batch, decoder_input_ids=decoder_prompt(model, 7))
        else:
            assert torch.equal(warm.sequences, run(model, batch, decoder_input_ids=decoder_prompt(model, 7)).sequences)
        assert store.stats().fallbacks == {"batch_size": 1}


def test_other_encoder_decoder_models_stay_cold() -> None:
    """An encoder-decoder type outside the tested list (mBART) runs cold as `encoder_decoder`."""
    torch.manual_seed(0)
    model = transformers.MBartForConditionalGeneration(transformers.MBartConfig(**_bart_sizes())).eval()
    ids = encoder_input("bart", seed=14)["input_ids"]
    with attached(model) as store:
        for _ in range(2):
            warm = model.generate(ids, max_new_tokens=4, do_sample=False, past_key_values=store)
            assert torch.equal(warm, model.generate(ids, max_new_tokens=4, do_sample=False))
        assert store.stats().fallbacks == {"encoder_decoder": 2}


def test_a_subclass_is_not_served() -> None:
    """Only the listed classes are served; a subclass may change generate and runs cold."""

    class CustomBart(transformers.BartForConditionalGeneration):  # type: ignore[misc]
        pass

    model = CustomBart(tiny("bart").config).eval()
    with attached(model) as store:
        assert store._store.profile.unsupported == "encoder_decoder"


def test_two_stores_on_one_model_each_serve_their_own_requests() -> None:
    """Stacked hooks: each store restores and stores only the requests passed to it."""
    model = tiny("bart")
    inputs = encoder_input("bart", seed=17)
    prompt = decoder_prompt(model, 7, 8)
    with attached(model) as first, attached(model) as second:
        same_as_cold(model, first, inputs, decoder_input_ids=prompt)
        same_as_cold(model, second, inputs, decoder_input_ids=prompt)
        assert first.stats().hit_tokens == 0 and second.stats().hit_tokens == 0
        same_as_cold(model, first, inputs, decoder_input_ids=prompt)
        assert first.stats().hit_tokens == 2 and second.stats().hit_tokens == 0
        assert first.stats().entries == 1 and second.stats().entries == 1


def test_detach_restores_generate_and_the_decoder_ids_step() -> None:
    """Detaching removes both instance patches."""
    model = tiny("bart")
    store = PrefixCache(model)
    assert "_prepare_decoder_input_ids_for_generation" in model.__dict__
    store.detach()
    assert "generate" not in model.__dict__
    assert "_prepare_decoder_input_ids_for_generation" not in model.__dict__


def test_low_level_api_refuses_seq2seq() -> None:
    """`lookup`/`insert`/`pin` key token ids only, not the encoder input: they raise."""
    with attached(tiny("bart")) as store:
        with pytest.raises(ValueError, match="encoder-decoder"):
            store.pin([2, 7, 8])
        with pytest.raises(ValueError, match="encoder-decoder"):
            store.lookup([2, 7, 8])


# ------------------------------------------------------------------------------ random conversations

_decoder_requests = st.lists(
    st.tuples(st.integers(0, 2), st.lists(st.integers(3, 6), max_size=10), st.booleans()), min_size=1, max_size=4
)


@pytest.mark.parametrize("name", ["bart", "t5", "florence2"])
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=_decoder_requests)
def test_random_requests_reuse_exactly_what_the_rules_allow(name: str, requests: list[Any]) -> None:
    """Random (encoder input, decoder prompt) requests equal cold runs and reuse exactly the longest
    decoder prefix stored under the same encoder input; a request may continue the previous answer."""
    model = tiny(name)
    start = model.generation_config.decoder_start_token_id
    stored: list[tuple[int, list[int]]] = []
    previous: tuple[int, list[int]] | None = None
    with attached(model) as store:
        for drawn, tail, continues in requests:
            source, prompt = next_request(previous, drawn, tail, continues, [start])
            before = store.stats().hit_tokens
            out = same_as_cold(model, store, encoder_input(name, source), decoder_input_ids=torch.tensor([prompt]))
            assert store.stats().hit_tokens - before == decoder_reuse(stored, source, prompt)
            sequence = out.sequences[0].tolist()
            stored.append((source, sequence[:-1]))
            previous = (source, sequence)
        assert not store.stats().fallbacks, store.stats().fallbacks
        store.check_integrity()


@pytest.mark.parametrize("where", ["argument", "model_default"])
def test_a_dynamic_cache_implementation_is_served(where: str) -> None:
    """`cache_implementation="dynamic"` (asked for, or the model's default) is what the store runs on: served exactly."""
    model = tiny("bart")
    inputs = encoder_input("bart", seed=31)
    prompt = decoder_prompt(model, 7, 8, 9)
    kwargs = {"cache_implementation": "dynamic"} if where == "argument" else {}
    saved = model.generation_config.cache_implementation
    if where == "model_default":
        model.generation_config.cache_implementation = "dynamic"
    try:
        with attached(model) as store:
            for _ in range(2):
                same_as_cold(model, store, inputs, decoder_input_ids=prompt, **kwargs)
            assert store.stats().fallbacks == {}
            assert store.stats().hit_tokens == prompt.shape[1] - 1
    finally:
        model.generation_config.cache_implementation = saved


def test_running_out_of_memory_inside_generate_reruns_the_call_cold(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decoder prefix is restored inside `generate`; out of memory twice there gives up that run (nothing stays
    pinned) and the call runs again cold, counted as `out_of_memory`; the stored prefix serves the next call."""
    from hf_prefix_cache.hooks import pipeline
    from hf_prefix_cache.model.working_cache import WorkingCache

    model = tiny("bart")
    inputs = encoder_input("bart", seed=41)
    prompt = decoder_prompt(model, 7, 8, 9)

    def failing_cache(profile: Any) -> Any:  # the working caches `pipeline.restore` makes
        cache = WorkingCache(profile)

        def restore(*args: Any, **kwargs: Any) -> None:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

        cache.restore = restore  # type: ignore[method-assign]
        return cache

    with attached(model, max_host_bytes="64MB") as store:  # the first error moves the entry to the host
        same_as_cold(model, store, inputs, decoder_input_ids=prompt)
        monkeypatch.setattr(pipeline, "WorkingCache", failing_cache)
        same_as_cold(model, store, inputs, decoder_input_ids=prompt)
        assert store.stats().fallbacks == {"out_of_memory": 1} and store.stats().hit_tokens == 0
        assert all(node.lock_ref == 0 for node in store._store._tree.iter_nodes())
        monkeypatch.undo()
        same_as_cold(model, store, inputs, decoder_input_ids=prompt)
        assert store.stats().hit_tokens == prompt.shape[1] - 1
        store.check_integrity()
