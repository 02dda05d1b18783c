"""Per-row settings equal `generate`'s: each row in one batch gives what `generate` alone gives with its settings.

Greedy rows with a logit bias, a repetition penalty (above and below 1) or `min_new_tokens`, and seeded
sampling rows (temperature, top_k, top_p, with a penalty too) decode together, joining at different steps;
each equals `generate` alone with the same settings, a seeded one after `torch.manual_seed(seed)` (how
transformers serve seeds). Then the generate kwargs transformers serve builds from OpenAI bodies
(`_build_generation_kwargs`, transformers >= 5.25) become Requests (`request_from_generate_kwargs`) whose
rows equal `generate` called as the server calls it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import build, random_prompt
from test_exactness import run_staggered

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.batching.batch import RunningBatch
from hf_prefix_cache.batching.eligibility import request_alone_reason
from hf_prefix_cache.batching.rows import EndReason, Request, Row
from hf_prefix_cache.batching.sampling import Sampling
from hf_prefix_cache.batching.scheduler import Scheduler
from hf_prefix_cache.batching.settings import request_from_generate_kwargs

# (Sampling, the same settings as generate kwargs)
CASES: list[tuple[Sampling, dict[str, Any]]] = [
    (Sampling(logit_bias={17: 4.0, 23: 3.0}), {"sequence_bias": {(17,): 4.0, (23,): 3.0}}),
    (Sampling(repetition_penalty=3.0), {"repetition_penalty": 3.0}),
    (Sampling(repetition_penalty=0.2), {"repetition_penalty": 0.2}),
    (Sampling(min_new_tokens=5), {"min_new_tokens": 5}),
    (Sampling(temperature=0.8, seed=1), {"do_sample": True, "temperature": 0.8, "top_k": 0}),
    (Sampling(temperature=1.0, top_k=20, seed=2), {"do_sample": True, "top_k": 20}),
    (Sampling(temperature=1.2, top_p=0.8, seed=3), {"do_sample": True, "temperature": 1.2, "top_p": 0.8, "top_k": 0}),
    (
        Sampling(temperature=0.7, top_k=40, top_p=0.9, seed=4, repetition_penalty=1.2, logit_bias={9: 2.0}),
        {
            "do_sample": True,
            "temperature": 0.7,
            "top_k": 40,
            "top_p": 0.9,
            "repetition_penalty": 1.2,
            "sequence_bias": {(9,): 2.0},
        },
    ),  # fmt: skip
]


def generate_alone(model: Any, prompt: list[int], new: int, seed: int | None, **kwargs: Any) -> list[int]:
    """`generate` on the prompt alone, seeded first as transformers serve seeds (`torch.manual_seed`)."""
    if seed is not None:
        torch.manual_seed(seed)
    ids = torch.tensor([prompt])
    kwargs.setdefault("do_sample", False)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, **kwargs)
    return list(out[0, len(prompt) :].tolist())


@pytest.mark.parametrize("name", ["llama", "lfm2"])
def test_each_rows_settings_equal_generate_with_them(name: str) -> None:
    """Eight rows with different settings, joining at different steps: each equals generate alone with its own."""
    model = build(name)
    store = PrefixCache(model)
    end = 2  # an end id the penalties and min_new_tokens act on
    prompts = [random_prompt(12 + 3 * i, seed=20 + i)[0].tolist() for i in range(len(CASES))]
    rows = [
        Row(Request(p, max_new_tokens=12, sampling=s, end_ids=frozenset({end})))
        for p, (s, _) in zip(prompts, CASES, strict=True)
    ]
    run_staggered(RunningBatch(store), rows, [0, 0, 1, 2, 2, 3, 5, 6])
    for prompt, row, (sampling, kwargs) in zip(prompts, rows, CASES, strict=True):
        want = generate_alone(model, prompt, 12, sampling.seed, eos_token_id=end, pad_token_id=0, **kwargs)
        assert row.tokens == want, (sampling, row.tokens, want)
        plain = generate_alone(model, prompt, 12, None, eos_token_id=end, pad_token_id=0)
        if sampling.temperature or sampling.repetition_penalty != 1.0:
            assert row.tokens != plain, sampling  # the setting changed the answer: the test sees it
    store.detach()


def test_a_seeded_row_is_reproducible_and_its_own() -> None:
    """The same seeded request twice, beside different neighbours: equal tokens; another seed differs."""
    model = build("llama")
    store = PrefixCache(model)
    prompt = random_prompt(20, seed=9)[0].tolist()
    sampling = Sampling(temperature=1.0, seed=11)
    runs = []
    for neighbours, seed in ((0, 11), (3, 11), (1, 12)):
        rows = [Row(Request(prompt, max_new_tokens=10, sampling=Sampling(1.0, seed=seed)))]
        rows += [Row(Request(random_prompt(15, seed=k)[0].tolist(), 6, sampling=sampling)) for k in range(neighbours)]
        run_staggered(RunningBatch(store), rows, list(range(len(rows)))[::-1])
        runs.append(rows[0].tokens)
    assert runs[0] == runs[1] != runs[2]
    store.detach()


# ---------------------------------------------------------------- from generate kwargs
def test_generate_kwargs_map_onto_the_request() -> None:
    """The server's kwargs become the row's settings; unmapped ones and None values are handled as generate would."""
    kwargs = {
        "max_new_tokens": 9, "eos_token_id": [2, 7], "do_sample": True, "temperature": 0.5, "top_k": 50,
        "top_p": 1.0, "seed": 3, "repetition_penalty": 1.1, "sequence_bias": {(5,): -2.0}, "stop_strings": "x",
        "min_new_tokens": None,
    }  # fmt: skip
    request = request_from_generate_kwargs([1, 2, 3], kwargs, tokenizer=object(), salt="t", timeout_s=4.0)
    assert request.max_new_tokens == 9 and request.end_ids == frozenset({2, 7})
    assert request.sampling == Sampling(0.5, top_k=50, seed=3, logit_bias={5: -2.0}, repetition_penalty=1.1)
    assert request.stop_strings == ("x",) and request.salt == "t" and request.timeout_s == 4.0
    assert request.generate_kwargs == {} and request_alone_reason(request) is None
    unset = {"max_new_tokens": 2, "do_sample": True, "temperature": None, "top_k": None, "top_p": None}
    assert request_from_generate_kwargs([1], unset).sampling.top_k == 50  # generate's global default
    greedy = request_from_generate_kwargs([1], {"max_new_tokens": 2, "temperature": 0.7, "top_p": 0.9}, eos_ids=[4])
    assert greedy.sampling.is_greedy and greedy.end_ids == frozenset({4})  # do_sample unset: generate is greedy
    alone = request_from_generate_kwargs([1], {"max_new_tokens": 2, "num_beams": 2, "sequence_bias": {(1, 2): 1.0}})
    assert alone.generate_kwargs == {"num_beams": 2, "sequence_bias": {(1, 2): 1.0}}
    assert request_alone_reason(alone) == "batch_alone:setting_num_beams"
    refused = request_from_generate_kwargs([1], {"max_new_tokens": 2, "do_sample": True, "temperature": 0.0})
    assert refused.generate_kwargs["temperature"] == 0.0  # generate raises for it: the row runs alone and says so
    marker = object()
    given = request_from_generate_kwargs([1], {"max_new_tokens": 2, "stop_strings": ["a"], "tokenizer": marker})
    assert given.tokenizer is marker and given.generate_kwargs == {}
    with pytest.raises(ValueError, match="max_new_tokens"):
        request_from_generate_kwargs([1], {"temperature": 1.0})


BODIES = [
    {"max_tokens": 10, "logit_bias": {"17": 5.0}, "frequency_penalty": 0.4, "seed": 4},
    {"max_tokens": 12, "temperature": 0.8, "top_p": 0.9, "seed": 5},
    {"max_tokens": 7, "temperature": 0, "frequency_penalty": -0.3},
    {"max_tokens": 11, "temperature": 1.3, "seed": 6, "logit_bias": {"9": 3.0}, "frequency_penalty": 0.2},
    {"max_tokens": 9, "temperature": 0.6, "top_p": 0.5, "seed": 7, "stop": ["never-met"]},
]


def test_bodies_as_transformers_serve_builds_them_equal_its_generate() -> None:
    """OpenAI bodies through transformers serve's own kwargs builder and the mapping, batched: each row equals
    `generate` called as the server calls it (seed popped and set, None values dropped, tokenizer passed)."""
    pytest.importorskip("fastapi")
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.utils import GenerationState

    if not hasattr(ChatCompletionHandler, "_build_generation_kwargs"):
        pytest.skip("transformers < 5.25 builds a GenerationConfig, not generate kwargs (its server is not ours)")
    from hf_prefix_cache.api.models import ModelUnavailableError, load_smollm2

    try:
        _, tokenizer = load_smollm2()
    except ModelUnavailableError as exc:
        pytest.skip(f"SmolLM2's tokenizer cannot be loaded here: {exc}")
    model = build("llama")
    model.generation_config.update(do_sample=True, eos_token_id=2)  # samples; top_k unset: generate's default, 50
    handler = ChatCompletionHandler(model_manager=None, generation_state=GenerationState())
    kwargs = [handler._build_generation_kwargs(body, model.generation_config) for body in BODIES]
    prompts = [random_prompt(14 + 2 * i, seed=40 + i)[0].tolist() for i in range(len(BODIES))]
    store = PrefixCache(model)
    scheduler = Scheduler(store)
    rows = [
        scheduler.submit(request_from_generate_kwargs(p, k, tokenizer=tokenizer))
        for p, k in zip(prompts, kwargs, strict=True)
    ]
    scheduler.run_until_idle()
    for prompt, kw, row in zip(prompts, kwargs, rows, strict=True):
        assert row.alone_reason is None and row.end_reason in (EndReason.LENGTH, EndReason.EOS)
        call = {name: value for name, value in kw.items() if value is not None}
        seed = call.pop("seed", None)
        assert row.tokens == generate_alone(
            model, prompt, call.pop("max_new_tokens"), seed, tokenizer=tokenizer, **call
        )
    store.detach()
