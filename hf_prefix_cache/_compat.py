"""Every difference between the transformers releases we support, in one place.

The tested range is `OLDEST_TESTED` to `NEWEST_TESTED` (`scripts/test` runs the whole suite on
both). What moved between them and how each is bridged here:

- **The cache argument** (5.24): model forwards, `generate` and model outputs call the cache
  `cache`; 5.23 called it `past_key_values` (Mamba-named models: `cache_params`). 5.24 keeps the
  old names as deprecated aliases at call time but not in `inspect.signature`. A caller may pass
  our store under any of `CACHE_KWARGS`; we hand `generate` and forwards the name the model's
  forward declares (`cache_argument`), which is also the key `generate` keeps it under in its
  model kwargs.
- **Which prompts `generate` slices** (5.24): 5.23 sliced the prompt by the cache's length only
  for `past_key_values`; 5.24 slices it for any cache unless every layer is linear attention
  (`generate_slices_prompt`). Where it does not slice, the decoder-only hook skips the restored
  prefix itself.
- **Mamba mixers** are called with `cache=` (5.24), `cache_params=` before: read with `cache_in`.
- **Linear layers count their tokens** (5.25): each linear-attention layer keeps
  `cumulative_length_linear`, `Cache.get_seq_length()` reads layer 0 (linear on most hybrids), and
  `generate` slices the prompt by it for every cache, all-linear ones included. A restore sets the
  counter to the restored length (`set_linear_length`); before 5.25 there is none to set.
- **Past recording** (5.25): a linear layer's `activate_past_recording` takes how many recurrent
  states to keep and then clones one state per forward into a history for `crop`; a hybrid layer
  with a sliding window shares that switch. `record_past` keeps no history (we never crop those).
- **Whisper** keeps the cache in `generate_kwargs["cache"]` (5.24): `cache_in` again.
- **transformers serve** (`hf-prefix-cache serve` builds on its classes): only 5.25's server, which
  runs the model in an engine process of its own, is supported (`SERVE_MIN`, `serve_requirement`);
  on older releases `serve` exits with one line naming the version found and what to install.
  Every class, method and parameter of the server we use is listed in `_SERVE_NEEDS` and checked
  at start by `check_serve`.

Anything else a release changes under us must fail loudly, naming the version found, the
versions tested and what to do (`untested_message`), never run cold in silence.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import warnings
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

import torch
import transformers
from packaging.version import Version

from hf_prefix_cache.errors import UnsupportedVersionError

logger = logging.getLogger("hf_prefix_cache")

#: The oldest and newest transformers releases the whole suite runs on (scripts/install, scripts/test).
OLDEST_TESTED = "5.23"
NEWEST_TESTED = "5.25"
#: What pyproject.toml allows: exactly the tested releases (tests/api/test_compat.py keeps them equal).
SUPPORTED = f">={OLDEST_TESTED},<5.26"
INSTALLED = Version(transformers.__version__)
#: 5.24 renamed `past_key_values` / `cache_params` to `cache` in forwards, `generate` and outputs.
CACHE_RENAMED = Version("5.24.0.dev0") <= INSTALLED
#: 5.25 gave every linear-attention layer its own token counter, which `Cache.get_seq_length()` reads on layer 0.
LINEAR_LAYERS_COUNT = Version("5.25.0.dev0") <= INSTALLED
#: 5.25: `crop` rolls a linear layer's states back through the history assisted decoding records (5.24 refused
#: assisted decoding on stateful models).
LINEAR_LAYERS_CROP = LINEAR_LAYERS_COUNT
#: Every name a supported release passes a cache under, newest first.
CACHE_KWARGS = ("cache", "past_key_values", "cache_params")
# Forward parameters with "cache" or "past" in their name that are not a cache we could serve: settings,
# positions, and the own caches of tested releases (Reformer's hashed buckets), which run cold by name.
_NOT_A_CACHE = frozenset({"use_cache", "cache_position", "past_length", "cache_length", "past_buckets_states"})
_REQUIRED_NAMES = (
    "Cache",
    "DynamicCache",
    "DynamicLayer",
    "DynamicSlidingWindowLayer",
    "LinearAttentionLayer",
    "LinearAttentionAndFullAttentionLayer",
    "DummyLayer",
)


def untested_message(what: str) -> str:
    """A message for something the installed transformers does that no tested release did.

    >>> "transformers" in untested_message("x")
    True
    """
    return (
        f"{what}. Installed: transformers {INSTALLED}; hf_prefix_cache is tested on {OLDEST_TESTED} to "
        f"{NEWEST_TESTED}. Install a tested release (pip install 'transformers{SUPPORTED}'), or upgrade "
        "hf_prefix_cache if a newer one supports this release."
    )


def is_tested_release() -> bool:
    """Whether the installed transformers lies in the tested range (by minor release)."""
    minor = Version(f"{INSTALLED.major}.{INSTALLED.minor}")
    return Version(OLDEST_TESTED) <= minor <= Version(NEWEST_TESTED)


def check_transformers() -> None:
    """Raise `UnsupportedVersionError` unless transformers is a 5.x from 5.23 with our cache classes.

    A 5.x newer than `NEWEST_TESTED` is allowed with a warning: each model's cache argument is
    then checked when a store is made (`cache_argument`), and a release that renamed it again
    raises there rather than running every request cold.
    """
    if not (Version(OLDEST_TESTED) <= INSTALLED < Version("6")):
        raise UnsupportedVersionError(
            untested_message(f"transformers {INSTALLED} is outside the range hf_prefix_cache supports")
        )
    from transformers import cache_utils

    missing = [name for name in _REQUIRED_NAMES if not hasattr(cache_utils, name)]
    if missing:
        raise UnsupportedVersionError(untested_message(f"transformers' cache_utils lacks {', '.join(missing)}"))
    if not is_tested_release():
        message = untested_message("This transformers release is newer than any hf_prefix_cache was tested on")
        logger.warning(message)
        warnings.warn(message, UserWarning, stacklevel=2)


def cache_argument(parameters: Iterable[str], owner: str) -> str | None:
    """The name a forward takes its cache under, or None for a model that keeps no cache.

    Raises:
        UnsupportedVersionError: the forward takes a cache-like argument by a name no tested
            release used (a release renamed it again): better an error now than every request cold.

    >>> cache_argument(["input_ids", "past_key_values", "use_cache"], "LlamaForCausalLM")  # 5.23's name
    'past_key_values'
    >>> cache_argument(["input_ids", "attention_mask"], "BertModel") is None
    True
    """
    names = set(parameters)
    known = next((name for name in CACHE_KWARGS if name in names), None)
    if known == "cache" and not CACHE_RENAMED:
        # Before 5.24 a `cache` parameter is a model's own legacy cache (XLM's dict), not a `Cache`.
        return None
    if known is not None:
        return known
    unknown = sorted(n for n in names if ("cache" in n or n.startswith("past")) and n not in _NOT_A_CACHE)
    if unknown:
        raise UnsupportedVersionError(
            untested_message(
                f"{owner}.forward takes its cache as {unknown[0]!r}, a name hf_prefix_cache does not know "
                f"(it knows {', '.join(CACHE_KWARGS)}), so no request could reuse a prefix"
            )
        )
    return None


def cache_in(kwargs: Mapping[str, Any]) -> Any:
    """The cache a call passed, under whichever supported name (None if none).

    >>> cache_in({"past_key_values": None, "cache": 3})
    3
    """
    for name in CACHE_KWARGS:
        value = kwargs.get(name)
        if value is not None:
            return value
    return None


def pop_cache(kwargs: MutableMapping[str, Any]) -> Any:
    """Remove the cache under every supported name from `kwargs`; return the one given (or None).

    >>> call = {"cache": 1, "max_new_tokens": 2}
    >>> pop_cache(call), call
    (1, {'max_new_tokens': 2})
    """
    given = cache_in(kwargs)
    for name in CACHE_KWARGS:
        kwargs.pop(name, None)
    return given


def generate_slices_prompt(cache_kwarg: str, layer_classes: Iterable[type]) -> bool:
    """Whether `generate` feeds the first forward only the ids past the cache's length.

    5.23 sliced for `past_key_values` only (not `cache_params`); 5.24 slices unless every layer
    of the cache is linear attention (`Cache.is_linear`, `generation/utils.py` `_prefill`).
    """
    if not CACHE_RENAMED:
        return cache_kwarg == "past_key_values"
    from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

    def is_linear(cls: type) -> bool:
        return issubclass(cls, LinearAttentionCacheLayerMixin) and not issubclass(cls, CacheLayerMixin)

    return not all(is_linear(cls) for cls in layer_classes)


def set_linear_length(layer: Any, length: int, device: torch.device | None) -> None:
    """Make a linear-attention layer count `length` tokens seen (5.25's `cumulative_length_linear`).

    A layer restored from a snapshot of `length` tokens has seen them, and `generate` slices the
    prompt by what layer 0 counts: left at 0, it would feed the restored prefix again. A no-op
    before 5.25 and for layers without the counter.
    """
    if LINEAR_LAYERS_COUNT and hasattr(layer, "cumulative_length_linear"):
        layer.cumulative_length_linear = torch.tensor(length, dtype=torch.long, device=device)


class _NoHistory(list):  # type: ignore[type-arg]
    """A recurrent-state history that keeps nothing: `extend` and `append` drop what they are given."""

    def extend(self, values: Iterable[Any]) -> None:
        pass

    def append(self, value: Any) -> None:
        pass


def record_past(layer: Any) -> None:
    """Switch on `layer`'s past recording (a sliding layer keeps every key), keeping no recurrent-state history.

    On 5.25 a hybrid layer's linear part shares the switch: with it on, every forward would clone its
    recurrent state into a history for `crop` (which we never call on these layers), and a call without
    `recurrent_states_to_keep` stores None there, which `Cache.get_recurrent_states_to_keep` cannot compare.
    """
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    if LINEAR_LAYERS_COUNT and isinstance(layer, LinearAttentionCacheLayerMixin):
        layer.activate_past_recording(recurrent_states_to_keep=0)
        layer.recurrent_states_history = {i: _NoHistory() for i in layer.recurrent_states_history}
    else:
        layer.activate_past_recording()


# ----------------------------------------------------------------- transformers serve
#: The oldest release whose server `hf-prefix-cache serve` builds on: 5.25 rewrote transformers serve around a
#: model process (`ModelLoader` pickled into it, `EngineClient`, `--api-server-count`), and only that one is ported.
SERVE_MIN = "5.25"
#: Whether the installed transformers has that server.
HAS_ENGINE_SERVE = Version(f"{SERVE_MIN}.0.dev0") <= INSTALLED

_SERVING = "transformers.cli.serving"
#: (module, attribute, parameters it must accept). A method is ``Class.method``.
_SERVE_NEEDS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    (
        "server",
        "build_server",
        (
            "model_manager",
            "chat_handler",
            "completion_handler",
            "response_handler",
            "transcription_handler",
            "systemone_handler",
            "enable_cors",
        ),
    ),
    (
        "model_manager",
        "ModelManager.__init__",
        ("loader", "generation_state", "model_timeout", "force_model", "engine_connection"),
    ),
    ("model_manager", "ModelManager.get_engine", ("model",)),
    ("model_manager", "ModelManager.preload_engine", ("force_model", "engine_connection")),
    ("model_manager", "ModelManager.list_models", ()),
    ("model_manager", "ModelLoader.__init__", ("device", "dtype", "trust_remote_code", "attn_implementation")),
    ("model_manager", "ModelLoader.load_model_and_processor", ("model_id", "on_progress")),
    ("model_manager", "EngineClient.__init__", ("model_id", "loader", "generation_state", "timeout", "connection")),
    ("model_manager", "EngineClient._send_request", ("method", "args", "streamer")),
    ("model_manager", "EngineClient.start_process", ("model", "loader", "generation_state", "api_servers")),
    ("utils", "Detokenizer.__init__", ("tokenizer", "queue", "response_parser")),
    ("utils", "GenerateRunner.submit", ("request_id", "function", "args", "stream")),
    ("utils", "GenerationState.__init__", ("continuous_batching", "compile")),
    ("utils", "run_until_parent_exits", ("target",)),
    (
        "chat_completion",
        "ChatCompletionHandler.__init__",
        ("model_manager", "generation_state", "chat_template_kwargs"),
    ),
    ("chat_completion", "ChatCompletionHandler.handle_request", ("body", "request_id")),
    ("completion", "CompletionHandler.__init__", ("model_manager", "generation_state")),
    ("completion", "CompletionHandler.handle_request", ("body", "request_id")),
    ("response", "ResponseHandler.__init__", ("model_manager", "generation_state", "chat_template_kwargs")),
    ("response", "ResponseHandler.handle_request", ("body", "request_id")),
    ("transcription", "TranscriptionHandler.__init__", ("model_manager",)),
    ("transcription", "TranscriptionHandler.handle_request", ("request",)),
    (
        "systemone",
        "SystemOneHandler.__init__",
        ("model_manager", "generation_state", "chat_template_kwargs", "decision_config"),
    ),
)


def serve_requirement() -> str | None:
    """Why `hf-prefix-cache serve` cannot run on the installed transformers (one line), or None when it can.

    >>> serve_requirement() is None or "pip install" in serve_requirement()
    True
    """
    if HAS_ENGINE_SERVE:
        return None
    return (
        f"hf-prefix-cache serve needs transformers >= {SERVE_MIN} (found {INSTALLED}): "
        f"pip install 'transformers>={SERVE_MIN}'"
    )


def check_serve() -> None:
    """Raise unless transformers' server has every class, method and parameter the serve front end uses.

    Raises:
        UnsupportedVersionError: transformers is older than `SERVE_MIN` (the one-line `serve_requirement`), or a
            release changed one of the places listed in `_SERVE_NEEDS`; the message names it.
        ImportError: the `serving` extra (FastAPI, uvicorn) is not installed.

    >>> check_serve()  # doctest: +SKIP
    """
    requirement = serve_requirement()
    if requirement is not None:
        raise UnsupportedVersionError(requirement)
    problems: list[str] = []
    for module_name, dotted, params in _SERVE_NEEDS:
        try:
            module = importlib.import_module(f"{_SERVING}.{module_name}")
        except (ImportError, NameError) as exc:  # NameError: its annotations name FastAPI classes
            raise ImportError(
                f"hf-prefix-cache serve needs transformers' serving extra (FastAPI, uvicorn): "
                f"pip install 'transformers[serving]>={SERVE_MIN}' prometheus_client (or pip install -e '.[serve]' in "
                f"a clone of hf-prefix-cache) ({type(exc).__name__}: {exc})"
            ) from exc
        target: object = module
        for part in dotted.split("."):
            target = getattr(target, part, None)
            if target is None:
                break
        if target is None:
            problems.append(f"{_SERVING}.{module_name} has no {dotted}")
            continue
        if params:
            have = set(inspect.signature(target).parameters)  # type: ignore[arg-type]
            missing = [p for p in params if p not in have]
            if missing:
                problems.append(f"{_SERVING}.{module_name}.{dotted} takes no {', '.join(missing)}")
    if problems:
        raise UnsupportedVersionError(
            untested_message(
                "transformers' server changed where hf-prefix-cache serve builds on it: " + "; ".join(problems)
            )
        )
