"""A call is read by `generate`'s parameter names however it passes them: positionally, by keyword, or wrongly."""

from __future__ import annotations

import pytest
import torch
from conftest import CACHE_NAME, cached_model, random_prompt
from transformers import GenerationConfig

from hf_prefix_cache import PrefixCache, reasons


def test_a_positional_generation_config_is_read_and_served() -> None:
    """`generate(ids, config)`: the config's settings are the call's (greedy, 4 tokens); a repeat reuses the prompt."""
    model = cached_model("llama")
    ids = random_prompt(24, seed=3)
    config = GenerationConfig(max_new_tokens=4, do_sample=False)
    cold = model.generate(ids, config, attention_mask=torch.ones_like(ids))
    store = PrefixCache(model)
    try:
        first = model.generate(ids, config, attention_mask=torch.ones_like(ids), **{CACHE_NAME: store})
        again = model.generate(ids, config, attention_mask=torch.ones_like(ids), **{CACHE_NAME: store})
        assert torch.equal(cold, first) and torch.equal(cold, again) and cold.shape[1] == 24 + 4
        assert store.stats().hit_tokens == 23
    finally:
        store.detach()


def test_a_positional_config_that_cannot_reuse_runs_cold_with_its_reason() -> None:
    """Returned attentions asked for in a positional config are seen: the call runs cold and says why."""
    model = cached_model("llama")
    ids = random_prompt(24, seed=3)
    config = GenerationConfig(max_new_tokens=3, do_sample=False, output_attentions=True, return_dict_in_generate=True)
    store = PrefixCache(model)
    try:
        model.generate(ids, config, **{CACHE_NAME: store})
        assert store.stats().fallbacks.get(reasons.OUTPUT_ATTENTIONS) == 1, store.stats().fallbacks
        assert store.stats().entries == 0
    finally:
        store.detach()


def test_an_argument_given_twice_raises_as_generate_would_and_stores_nothing() -> None:
    """The ids positionally and as `inputs=`: Python's error for a doubled argument, and nothing stored."""
    model = cached_model("llama")
    ids = random_prompt(24, seed=3)
    store = PrefixCache(model)
    try:
        with pytest.raises(TypeError, match="multiple values"):
            model.generate(ids, inputs=ids, max_new_tokens=2, **{CACHE_NAME: store})
        assert store.stats().entries == 0
    finally:
        store.detach()


def test_a_family_registered_twice_is_refused_by_name() -> None:
    """Registering a second family under a taken name raises a `ValueError` naming it (not an `assert`, which
    `python -O` strips), and the registered family still serves."""
    from hf_prefix_cache.hooks.patching import Family, family_of, register

    model = cached_model("llama")
    with pytest.raises(ValueError, match="'decoder_only' is registered already"):
        register(Family("decoder_only", lambda *args: None))  # type: ignore[arg-type]
    assert family_of(model).name == "decoder_only" and family_of(model).make_hook is not None
