"""Stop strings end a row at exactly the token where `generate(..., stop_strings=, tokenizer=)` ends it.

On a tiny random Llama with SmolLM2's real tokenizer (49k byte-level tokens, so random answers hold
all kinds of tokens) and on the real SmolLM2: stop strings taken from each request's own greedy answer,
one inside a token, one across two tokens, one across the prompt's end, one that never occurs; rows
joining at different steps; every row's tokens equal `generate` alone with the same stop strings.
Skipped where SmolLM2's tokenizer cannot be loaded (CI requires it).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import transformers
from conftest import CACHE_NAME
from test_exactness import run_staggered
from transformers.generation.stopping_criteria import StopStringCriteria

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.api.sample_text import HANDBOOK
from hf_prefix_cache.batching.batch import RunningBatch
from hf_prefix_cache.batching.rows import EndReason, Request, Row
from hf_prefix_cache.batching.scheduler import Scheduler
from hf_prefix_cache.batching.stops import StopStrings
from hf_prefix_cache.store.lookup import as_token_list

NEVER = "zq#never@qz"


@pytest.fixture(scope="module")
def tokenizer(smollm2: tuple[Any, Any]) -> Any:
    return smollm2[1]


@pytest.fixture(scope="module")
def tiny(tokenizer: Any) -> Any:
    """A 2-layer random Llama over SmolLM2's vocabulary (its answers are random tokens of the real vocabulary)."""
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.max_length = None
    return model


def greedy(model: Any, prompt: list[int], new: int, **kwargs: Any) -> list[int]:
    """`generate` alone, greedy: the answer's tokens."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, **kwargs)
    return list(out[0, len(prompt) :].tolist())


def texts(tokenizer: Any, ids: list[int]) -> list[str]:
    return [tokenizer.decode([token]) for token in ids]


def inside_one(tokenizer: Any, answer: list[int]) -> str:
    """A piece strictly inside one token of the answer (neither its first nor its last character)."""
    for text in texts(tokenizer, answer)[1:]:
        if len(text) >= 4 and text.isascii() and text[1:-1].strip():
            return text[1:-1]
    raise AssertionError(f"no token of {texts(tokenizer, answer)} has an inner piece")


def across_two(tokenizer: Any, answer: list[int], start: int = 1) -> str:
    """The last two characters of one token and the first two of the next."""
    pieces = texts(tokenizer, answer)
    for a, b in zip(pieces[start:], pieces[start + 1 :], strict=False):
        if len(a) >= 2 and len(b) >= 2 and (a + b).isascii():
            return a[-2:] + b[:2]
    raise AssertionError(f"no two tokens of {pieces} to straddle")


def end_of(tokenizer: Any, prompt: list[int], first: int) -> str:
    """A stop string that begins in the prompt's last token and ends in the answer's first token."""
    return tokenizer.decode(prompt[-1:])[-2:] + tokenizer.decode([first])[:1]


def check_rows(model: Any, tokenizer: Any, prompts: list[list[int]], stops: list[tuple[str, ...]], new: int) -> None:
    """Rows with these stop strings, joining at steps 0, 1, 3, 4...: each equals `generate` with its stops."""
    eos = frozenset({tokenizer.eos_token_id})
    store = PrefixCache(model)
    rows = [
        Row(Request(p, max_new_tokens=new, end_ids=eos, stop_strings=s, tokenizer=tokenizer))
        for p, s in zip(prompts, stops, strict=True)
    ]
    run_staggered(RunningBatch(store), rows, [0, 1, 3, 4, 6][: len(rows)])
    for prompt, stop, row in zip(prompts, stops, rows, strict=True):
        want = greedy(model, prompt, new, stop_strings=list(stop), tokenizer=tokenizer)
        assert row.tokens == want, (stop, texts(tokenizer, row.tokens), texts(tokenizer, want))
        if stop and NEVER not in stop:
            assert row.end_reason is EndReason.STOP and len(row.tokens) < new, (stop, texts(tokenizer, row.tokens))
        # the stored sequence is generate's: a second request for the same prompt and answer hits all of it
        fed = [*prompt, *row.tokens[:-1]]
        with store.request() as scope:
            greedy(model, fed, 1, **{CACHE_NAME: store})
        assert scope.cached_tokens == len(fed) - 1
    store.check_integrity()
    store.detach()


def test_stop_strings_on_a_tiny_model_equal_generate(tiny: Any, tokenizer: Any) -> None:
    """Stop strings inside a token, across two tokens, never met, and two at once: each row equals generate."""
    prompts = [tokenizer(text)["input_ids"] for text in ("The quick brown fox", "Once upon a time there", "Rules:")]
    prompts += [tokenizer("A longer prompt, so the rows have different lengths: " * 3)["input_ids"]]
    answers = [greedy(tiny, p, 16) for p in prompts]
    stops = [
        (inside_one(tokenizer, answers[0]),),
        (across_two(tokenizer, answers[1], start=3),),
        (NEVER,),
        (NEVER, across_two(tokenizer, answers[3], start=5), inside_one(tokenizer, answers[3][8:])),
    ]
    check_rows(tiny, tokenizer, prompts, stops, 16)


def test_a_stop_string_across_the_prompts_end_ends_the_first_token_as_generate_does(tiny: Any, tokenizer: Any) -> None:
    """generate checks the prompt with the answer: a stop string from the prompt's end into the first token ends
    the row at that token (at admission); the batch does the same."""
    prompt = tokenizer("The quick brown fox")["input_ids"]
    first = greedy(tiny, prompt, 1)[0]
    stop = end_of(tokenizer, prompt, first)
    assert greedy(tiny, prompt, 8, stop_strings=[stop], tokenizer=tokenizer) == [first]
    row = Row(Request(prompt, max_new_tokens=8, stop_strings=stop, tokenizer=tokenizer))
    store = PrefixCache(tiny)
    batch = RunningBatch(store)
    assert batch.admit(row) and not batch.rows
    assert row.tokens == [first] and row.end_reason is EndReason.STOP
    store.detach()


def test_stop_strings_on_smollm2_equal_generate(smollm2: tuple[Any, Any]) -> None:
    """The real model's chat answers, with stop strings taken from them, end where generate ends them."""
    model, tokenizer = smollm2
    system = {"role": "system", "content": HANDBOOK[:600]}
    questions = ("What is the first rule?", "Name three colours.", "Say hello.")
    prompts = [
        as_token_list(
            tokenizer.apply_chat_template([system, {"role": "user", "content": q}], add_generation_prompt=True)
        )
        for q in questions
    ]
    answers = [greedy(model, p, 14) for p in prompts]
    stops = [(inside_one(tokenizer, answers[0]),), (across_two(tokenizer, answers[1], start=2),), (NEVER, "\n\n\n\n")]
    check_rows(model, tokenizer, prompts, stops, 14)


def test_hit_equals_stop_string_criteria_on_the_whole_sequence(tokenizer: Any) -> None:
    """`StopStrings.hit` on the last window equals transformers' criteria on prompt and answer, at every step."""
    stops = ("stop", " the", "ing ", "\n\n")
    stop_strings = StopStrings(tokenizer, stops)
    criteria = StopStringCriteria(tokenizer, list(stops))
    words = tokenizer("we stop the singing now, stopping things\n\n; ing the st op sto pping")["input_ids"]
    rng = random.Random(0)
    for _ in range(40):
        prompt = [rng.choice(words) for _ in range(rng.randint(1, 3))]
        answer = [rng.choice(words) for _ in range(8)]
        for n in range(1, len(answer) + 1):
            whole = criteria(torch.tensor([[*prompt, *answer[:n]]]), None)[0].item()  # type: ignore[arg-type]
            assert stop_strings.hit(prompt, answer[:n]) == whole


def test_stop_strings_need_a_tokenizer() -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        Request([1, 2], max_new_tokens=2, stop_strings=("x",))
    assert Request([1, 2], max_new_tokens=2, stop_strings="x", tokenizer=object()).stop_strings == ("x",)  # type: ignore[arg-type]


def test_a_row_running_alone_stops_at_its_stop_string_as_generate_does(tiny: Any, tokenizer: Any) -> None:
    """A row with stop strings and a setting the batch lacks runs alone and ends where generate ends it."""
    prompt = tokenizer("Once upon a time there")["input_ids"]
    stop = across_two(tokenizer, greedy(tiny, prompt, 12, no_repeat_ngram_size=2), start=2)
    store = PrefixCache(tiny)
    scheduler = Scheduler(store)
    request = Request(
        prompt, 12, stop_strings=(stop,), tokenizer=tokenizer, generate_kwargs={"no_repeat_ngram_size": 2}
    )
    row = scheduler.submit(request)
    scheduler.run_until_idle()
    assert row.alone_reason == "batch_alone:setting_no_repeat_ngram_size" and row.end_reason is EndReason.STOP
    assert row.tokens == greedy(tiny, prompt, 12, no_repeat_ngram_size=2, stop_strings=[stop], tokenizer=tokenizer)
    store.detach()


def test_a_repeated_stop_set_reuses_its_criteria(tokenizer: Any) -> None:
    """Requests repeating a tokenizer's stop set share transformers' criteria (built once); another set does not."""
    first, again = StopStrings(tokenizer, ("stop", "end")), StopStrings(tokenizer, ("stop", "end"))
    other = StopStrings(tokenizer, ("end", "stop"))
    assert first._criteria is again._criteria and other._criteria is not first._criteria
