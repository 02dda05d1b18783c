"""The transformers releases we support: both cache names work, the tested range is stated, and a rename fails loudly."""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from conftest import LOGIT_TOL, cached_model, random_prompt

from hf_prefix_cache import PrefixCache, _compat
from hf_prefix_cache.errors import UnsupportedVersionError
from hf_prefix_cache.model.own_caches import own_cache_for

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import support_matrix  # noqa: E402


def test_pyproject_allows_exactly_the_tested_range() -> None:
    """pyproject.toml's transformers requirement is the compat module's tested range."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.findall(r'"transformers([<>=!~,.\d]+)"', pyproject) == [_compat.SUPPORTED]


def test_the_install_script_builds_the_oldest_tested_release() -> None:
    """scripts/install makes the second environment with the compat module's oldest release."""
    assert f"OLDEST_TESTED={_compat.OLDEST_TESTED}" in (ROOT / "scripts" / "install").read_text()


def test_the_install_script_pins_the_newest_tested_release() -> None:
    """scripts/install puts the compat module's newest release in the main environment, even over an older one."""
    assert f"NEWEST_TESTED={_compat.NEWEST_TESTED}" in (ROOT / "scripts" / "install").read_text()


def test_the_installed_release_is_one_we_tested() -> None:
    """A newer release fails here until the suite has passed on it and NEWEST_TESTED names it."""
    assert _compat.is_tested_release(), _compat.untested_message("The suite runs on an untested transformers")


@pytest.mark.parametrize("name", ["cache", "past_key_values"])
def test_both_cache_names_reuse_and_equal_cold(name: str) -> None:
    """`generate(cache=store)` and `generate(past_key_values=store)` both hit, with cold tokens and logits."""
    model = cached_model("llama")
    prompt = random_prompt(48, seed=3)
    cold = model.generate(prompt, max_new_tokens=6, output_logits=True, return_dict_in_generate=True)
    store = PrefixCache(model)
    try:
        model.generate(prompt[:, :40], max_new_tokens=2, **{name: store})
        warm = model.generate(
            prompt, max_new_tokens=6, output_logits=True, return_dict_in_generate=True, **{name: store}
        )
        stats = store.stats()
    finally:
        store.detach()
    assert stats.hit_tokens >= 40 and not stats.fallbacks
    assert torch.equal(warm.sequences, cold.sequences)
    for a, b in zip(warm.logits, cold.logits, strict=True):
        assert (a - b).abs().max().item() < LOGIT_TOL


def _served_classes() -> dict[str, str]:
    """The classes the support matrix serves, each with its model type."""
    rows = [
        support_matrix._row_from_line(line) for line in support_matrix.parse(support_matrix.DOC.read_text()).values()
    ]
    return {row.model_class: row.model_type for row in rows if row.status == "served"}


def test_every_served_class_takes_a_cache_argument_the_compat_module_knows() -> None:
    """Each class the support matrix serves declares its cache under a known name on this release (or, for a model
    type with a cache of its own, under the name its bridge passes: RWKV's `state`)."""
    missing = []
    classes = _served_classes()
    assert len(classes) > 150
    for name, model_type in sorted(classes.items()):
        cls = getattr(transformers, name, None)
        if cls is None:
            continue  # built from a submodule; its family's own tests cover it
        parameters = inspect.signature(cls.forward).parameters
        own = own_cache_for(model_type)
        if own is not None and own.cache_kwarg is not None:
            if own.cache_kwarg not in parameters:
                missing.append(name)
        elif _compat.cache_argument(parameters, name) is None:
            missing.append(name)
    assert not missing, f"served classes whose forward takes none of {_compat.CACHE_KWARGS}: {missing}"


def test_the_hooks_hand_generate_the_name_this_release_uses() -> None:
    """On 5.24 and later the forward's name is `cache`; on 5.23 `past_key_values` (Mamba: `cache_params`)."""
    store = PrefixCache(cached_model("llama"))
    mamba = PrefixCache(cached_model("mamba"))
    try:
        expected = ("cache", "cache") if _compat.CACHE_RENAMED else ("past_key_values", "cache_params")
        assert (store._store.profile.cache_kwarg, mamba._store.profile.cache_kwarg) == expected
        # generate slices the prompt by the cache for attention models; not for all-recurrent ones.
        assert store._store.profile.prompt_sliced and not mamba._store.profile.prompt_sliced
    finally:
        store.detach()
        mamba.detach()


def test_a_renamed_cache_argument_fails_loudly_not_cold() -> None:
    """A forward that takes its cache under a name no tested release used raises with the version and what to do."""
    model = cached_model("llama")

    def forward(input_ids: Any = None, kv_cache: Any = None, use_cache: Any = None, **kwargs: Any) -> Any:
        raise AssertionError("never run")

    model.forward = forward
    try:
        with pytest.raises(UnsupportedVersionError) as info:
            PrefixCache(model)
    finally:
        del model.forward
    message = str(info.value)
    assert "'kv_cache'" in message and f"transformers {transformers.__version__}" in message
    assert f"tested on {_compat.OLDEST_TESTED} to {_compat.NEWEST_TESTED}" in message
    assert f"pip install 'transformers{_compat.SUPPORTED}'" in message


def test_a_model_that_keeps_no_cache_is_named_as_such() -> None:
    """A forward without any cache-like argument is the quiet `no_cache_argument` case, not an error."""
    assert _compat.cache_argument(["input_ids", "attention_mask", "use_cache", "cache_position"], "X") is None


def test_a_release_outside_the_range_is_refused_with_the_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 6 (or older than 5.23) raises at import time, naming the version found and the range."""
    monkeypatch.setattr(_compat, "INSTALLED", _compat.Version("6.0.0"))
    with pytest.raises(UnsupportedVersionError, match=re.escape("Installed: transformers 6.0.0")):
        _compat.check_transformers()


def test_an_untested_newer_release_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 5.x newer than NEWEST_TESTED imports with a warning that names the tested range."""
    monkeypatch.setattr(_compat, "INSTALLED", _compat.Version("5.99.0"))
    with pytest.warns(UserWarning, match="newer than any hf_prefix_cache was tested on"):
        _compat.check_transformers()
