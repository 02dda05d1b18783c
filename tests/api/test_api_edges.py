"""Edges of the public API: what pin, lookup and the constructor accept, and stores sharing or mixing models."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from conftest import Hits, assert_same_as_cold, build, distinct_prompt, generate

from hf_prefix_cache import IncompatibleModelError, PrefixCache


@pytest.fixture(scope="module")
def smollm2() -> tuple[Any, Any]:
    from hf_prefix_cache.api.models import load_smollm2

    return load_smollm2()


def test_pin_accepts_what_apply_chat_template_returns(smollm2: tuple[Any, Any]) -> None:
    """`pin(tok.apply_chat_template(..., tokenize=True))` pins its input_ids, then a chat after it reuses them."""
    model, tok = smollm2
    system = [{"role": "system", "content": "You are a terse assistant."}]
    encoded = tok.apply_chat_template(system, tokenize=True)
    store = PrefixCache(model)
    try:
        assert store.pin(encoded) == len(encoded["input_ids"])
        chat = [*system, {"role": "user", "content": "Name a colour."}]
        ids = tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_tensors="pt")["input_ids"]
        hits = Hits(store)
        assert_same_as_cold(model, ids, store, new=3)
        assert hits.last() == len(encoded["input_ids"])
    finally:
        store.detach()


def test_pin_rejects_float_ids_and_more_than_the_budget() -> None:
    """Float ids raise a TypeError; a prefix larger than every budget raises a ValueError naming the budgets."""
    model = build("llama")
    store = PrefixCache(model, max_bytes=1000)
    try:
        with pytest.raises(TypeError, match="integers"):
            store.pin(torch.tensor([[1.0, 2.0, 3.0]]))
        with pytest.raises(TypeError, match="integers"):
            store.pin([1, 2.5, 3])
        with pytest.raises(ValueError, match="budgets"):
            store.pin(distinct_prompt(1, 40))
        assert store.stats().entries == 0
    finally:
        store.detach()


def test_lookup_of_no_tokens_says_so() -> None:
    """`lookup([])` raises a ValueError that says it needs a token."""
    store = PrefixCache(build("llama"), attach=False)
    with pytest.raises(ValueError, match="at least one token"):
        store.lookup([])


@pytest.mark.parametrize(("ttl", "seconds"), [("1h", 3600.0), ("30m", 1800.0), ("90s", 90.0), (2.5, 2.5)])
def test_ttl_takes_seconds_or_a_duration_string(ttl: Any, seconds: float) -> None:
    """ttl is a number of seconds or a string with a unit."""
    assert PrefixCache(build("llama"), ttl=ttl, attach=False)._store.ttl == seconds


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"ttl": "soon"}, ValueError),
        ({"ttl": 0}, ValueError),
        ({"ttl": "-1h"}, ValueError),
        ({"max_bytes": 1.5}, ValueError),
        ({"max_bytes": [1]}, TypeError),
        ({"max_host_bytes": "lots"}, ValueError),
    ],
)
def test_unreadable_budgets_and_durations_are_rejected_clearly(kwargs: dict[str, Any], error: type) -> None:
    """A budget or ttl that cannot be read raises an error naming the value and an example."""
    with pytest.raises(error, match=r"e\.g\.|got"):
        PrefixCache(build("llama"), attach=False, **kwargs)


def test_whole_float_budgets_are_bytes() -> None:
    """`max_bytes=2e6` is two million bytes."""
    assert PrefixCache(build("llama"), max_bytes=2e6, attach=False).max_bytes == 2_000_000


def test_detaching_one_of_two_stores_leaves_the_other_serving() -> None:
    """With two stores on one model, detaching either leaves the other one hooked and reusing."""
    model = build("llama")
    ids = distinct_prompt(1)
    for detach_first in (False, True):
        first, second = PrefixCache(model), PrefixCache(model)
        keep, drop = (second, first) if detach_first else (first, second)
        hits = Hits(keep)
        assert_same_as_cold(model, ids, keep)
        drop.detach()
        assert_same_as_cold(model, ids, keep)
        assert hits.last() == ids.shape[1] - 1
        keep.detach()
        assert "generate" not in model.__dict__


def test_a_store_of_another_model_of_the_same_class_says_what_is_wrong() -> None:
    """Passing model A's store to a same-class model B names the mix-up, hooked or not."""
    a, b = build("llama"), build("llama")
    store_a = PrefixCache(a)
    ids = distinct_prompt(1)
    with pytest.raises(AttributeError, match="another model, even of the same class"):
        generate(b, ids, past_key_values=store_a)
    store_b = PrefixCache(b)
    with pytest.raises(IncompatibleModelError, match="even among models of one class"):
        generate(b, ids, past_key_values=store_a)
    store_a.detach()
    store_b.detach()


def test_a_misspelt_generate_kwarg_is_rejected_by_transformers_without_a_cold_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A typo in a kwarg raises transformers' error; the store logs no cold run for it."""
    model = build("llama")
    store = PrefixCache(model)
    ids = distinct_prompt(1)
    try:
        with caplog.at_level(logging.DEBUG, logger="hf_prefix_cache"), pytest.raises(ValueError, match="max_new_tokns"):
            model.generate(ids, past_key_values=store, max_new_tokns=3)
        assert not [r for r in caplog.records if "running cold" in r.getMessage()]
    finally:
        store.detach()
