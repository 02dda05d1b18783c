"""Step 1 of a decoder-only call (`checks.check_call`) and the settings it reads (`checks.GenerationSettings`).

The end-to-end outcome of each refusal (counted reason, output equal to a cold run) is the bad-input
catalogue's (`test_bad_inputs.py`); these tests pin what the one pass relies on: settings read once in
`generate`'s order, `is_plain` covering every shared settings rule, and the first reason winning.
"""

from __future__ import annotations

import inspect
import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import GenerationConfig

from hf_prefix_cache import reasons
from hf_prefix_cache.hooks import checks, refusals, whisper
from hf_prefix_cache.hooks.checks import check_call
from hf_prefix_cache.model.profile import profile_model
from hf_prefix_cache.testing.tiny_attention import tiny_llama


def _settings(kwargs: dict[str, Any], passed: GenerationConfig | None = None, **model_config: Any) -> Any:
    model = SimpleNamespace(generation_config=GenerationConfig(**model_config))
    return checks.GenerationSettings(model, passed, kwargs)


def test_a_setting_is_read_from_the_kwarg_then_the_passed_config_then_the_models() -> None:
    """A kwarg (even None) wins over the passed config, which wins over the model's, as `generate` reads them."""
    passed = GenerationConfig(num_beams=3, max_new_tokens=7)
    settings = _settings({"num_beams": 2, "use_cache": None}, passed, num_beams=4, max_new_tokens=5, use_cache=False)
    assert (settings.num_beams, settings.max_new_tokens, settings.use_cache) == (2, 7, None)
    assert _settings({}, None, max_new_tokens=5).max_new_tokens == 5
    assert _settings({}, None).cache_implementation is None


def test_derived_facts_are_those_of_the_settings() -> None:
    """`expand`, `assisted` and `static` follow the settings they come from."""
    assert _settings({"num_beams": 2, "num_return_sequences": 3}).expand == 3
    assert _settings({"prompt_lookup_num_tokens": 3}).assisted
    assert _settings({"cache_implementation": "sliding_window"}).static == "sliding_window"
    # A model-default "hybrid" is dropped by generate (a dynamic cache); asked for by the call, it is static.
    assert _settings({}, None, cache_implementation="hybrid").static is None
    assert _settings({"cache_implementation": "hybrid"}).static == "hybrid"


def test_every_setting_a_family_reads_is_read_once() -> None:
    """The settings are slots filled when made: Whisper's refused settings are among them, other names do not exist."""
    assert set(whisper._REFUSED_SETTINGS) <= set(checks.SETTINGS)
    settings = _settings({})
    assert not hasattr(settings, "__dict__")
    with pytest.raises(AttributeError):
        _ = settings.not_a_setting


_VALUES: dict[str, tuple[Any, ...]] = {
    "num_beams": (None, 1, 2),
    "num_return_sequences": (None, 1, 3),
    "use_cache": (None, True, False),
    "prompt_lookup_num_tokens": (None, 3),
    "cache_implementation": (None, "dynamic", "static", "offloaded", "hybrid"),
    "output_attentions": (None, True),
    "output_hidden_states": (None, True),
}


def test_plain_settings_pass_every_shared_settings_rule() -> None:
    """Where `is_plain` holds no shared settings rule refuses, in any mode; every other combination some rule
    refuses in some mode, so a check may skip the rules exactly when the settings are plain."""
    modes = [refusals.Modes(expands=e, assisted=a) for e in (False, True) for a in (False, True)]
    served_sets = [frozenset(), frozenset({"dynamic"})]
    plain = 0
    for values in itertools.product(*_VALUES.values()):
        settings = _settings(dict(zip(_VALUES, values, strict=True)))
        found = {
            refusals.decoding_problem(settings, mode)
            or refusals.cache_implementation_problem(settings, served)
            or refusals.output_problem(settings)
            for mode in modes
            for served in served_sets
        }
        if settings.is_plain:
            plain += 1
            assert found == {None}, values
        else:
            assert found != {None}, values
    assert plain == 2 * 2 * 2  # beams and sequences of one (or unset), the cache used (or unset)


def _check(model: Any, ids: Any, **kwargs: Any) -> checks.Prompt | str | None:
    signature = inspect.signature(model.generate)
    arguments = signature.bind_partial(ids, **kwargs).arguments
    checked = check_call(profile_model(model), model, signature, ids, arguments, arguments.get("kwargs", {}))
    if checked.settings is None:
        assert checked.reason is not None and not checked.rows
        return checked.reason
    return checks.Prompt(checked.rows, checked.pads, checked.reason)


def test_a_plain_call_reads_its_prompt() -> None:
    """A plain call passes every check and comes back with its rows read, its padding and no reason."""
    model = tiny_llama()
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    assert _check(model, ids, attention_mask=mask, max_new_tokens=2, do_sample=False) == (
        [[5, 6, 7], [9, 10]],
        (0, 1),
        None,
    )


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        # A refused argument comes before ids that are no ids, and before every later check.
        ({"ids": torch.ones(1, 3), "inputs_embeds": torch.ones(1, 3, 8)}, reasons.INPUTS_EMBEDS),
        ({"ids": torch.ones(1, 3), "num_beams": 2}, reasons.NO_INPUT_IDS),
        # Media for a model without media comes before a model kwarg and the settings.
        (
            {"pixel_values": torch.ones(1, 3), "foo": 1, "num_beams": 2},
            reasons.with_detail(reasons.MEDIA_INPUTS, "llama"),
        ),
        ({"foo": 1, "use_cache": False}, reasons.with_detail(reasons.MODEL_KWARG, "foo")),
        ({"use_cache": False, "cache_implementation": "offloaded"}, reasons.USE_CACHE_FALSE),
        ({"cache_implementation": "offloaded"}, reasons.with_detail(reasons.CACHE_IMPLEMENTATION, "offloaded")),
        # The settings come before the mask read with the prompt.
        (
            {"output_attentions": True, "return_dict_in_generate": True, "attention_mask": torch.ones(1, 2)},
            reasons.OUTPUT_ATTENTIONS,
        ),
        ({"attention_mask": torch.ones(1, 2)}, checks.Prompt([[5, 6, 7]], (0,), reasons.ATTENTION_MASK_SHAPE)),
        # A value of None is not given: nothing to refuse.
        ({"inputs_embeds": None, "pixel_values": None, "foo": None}, checks.Prompt([[5, 6, 7]], (0,), None)),
    ],
)
def test_the_first_reason_in_check_order_is_counted(kwargs: dict[str, Any], reason: Any) -> None:
    """With several problems, the reason of the earliest check is the one counted."""
    model = tiny_llama()
    ids = kwargs.pop("ids", torch.tensor([[5, 6, 7]]))
    assert _check(model, ids, **kwargs) == reason
