"""What `hf-prefix-cache serve` relies on in transformers' own server (`transformers.cli.serving`), checked at start.

The server is transformers' FastAPI app, assembled from its own classes; `frontends/serve/`
subclasses four of them and calls a handful of their methods. Every such place is listed in
`_NEEDS` (module, name, and the parameters we pass or override), and `check_serve` verifies
them all before a model is loaded, so a release that changes one fails at start with a message
naming it rather than serving requests wrongly.

Differences between the tested releases (5.23, 5.24), as read from their wheels:

- `/v1/models`: 5.24 lists the forced model (`ModelManager.list_models`); 5.23 calls
  `ModelManager.get_gen_models`, which scans only the hub cache and answers 500 when there is
  none (a fresh, offline machine). `LISTS_FORCED_MODEL` says which; on 5.23 the serve front end
  answers for the forced model itself.
- `ModelManager.process_model_name`: 5.23 appends ``@main`` to a local folder too (the model id
  in responses is ``<folder>@main``); 5.24 keeps the folder as it is.
- Everything else we use (handlers, `GenerationState.get_manager`, `GenerateManager.submit` /
  `async_submit`, `TimedModel.delete_model`, `build_server`) is the same in both.

Imports nothing from the package but `_compat` (the version) and `errors`.
"""

from __future__ import annotations

import importlib
import inspect

from packaging.version import Version

from hf_prefix_cache._compat import INSTALLED, untested_message
from hf_prefix_cache.errors import UnsupportedVersionError

#: 5.24's `/v1/models` lists the forced model; 5.23's scans only the hub cache (500 when it has none).
LISTS_FORCED_MODEL = Version("5.24.0.dev0") <= INSTALLED

_SERVING = "transformers.cli.serving"
#: (module, attribute, parameters it must accept). A method is ``Class.method``.
_NEEDS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
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
            "generation_state",
            "enable_cors",
        ),
    ),
    (
        "model_manager",
        "ModelManager.__init__",
        ("device", "dtype", "trust_remote_code", "attn_implementation", "model_timeout", "force_model"),
    ),
    ("model_manager", "ModelManager.load_model_and_processor", ("model_id_and_revision",)),
    ("model_manager", "ModelManager.process_model_name", ("model_id",)),
    ("model_manager", "TimedModel.delete_model", ()),
    ("utils", "GenerationState.__init__", ("continuous_batching", "compile")),
    ("utils", "GenerationState.get_manager", ("model_id", "use_cb")),
    ("utils", "GenerateManager.submit", ("fn",)),
    ("utils", "GenerateManager.async_submit", ("fn",)),
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
    ("transcription", "TranscriptionHandler.__init__", ("model_manager", "generation_state")),
    ("transcription", "TranscriptionHandler.handle_request", ("request",)),
    (
        "systemone",
        "SystemOneHandler.__init__",
        ("model_manager", "generation_state", "chat_template_kwargs", "decision_config"),
    ),
    ("model_manager", "ModelManager.get_gen_models" if not LISTS_FORCED_MODEL else "ModelManager.list_models", ()),
)


def check_serve() -> None:
    """Raise unless transformers' server has every class, method and parameter the serve front end uses.

    Raises:
        ImportError: the `serving` extra (FastAPI, uvicorn) is not installed.
        UnsupportedVersionError: a release changed one of the places listed in `_NEEDS`; the
            message names it.

    >>> check_serve()  # doctest: +SKIP
    """
    problems: list[str] = []
    for module_name, dotted, params in _NEEDS:
        try:
            module = importlib.import_module(f"{_SERVING}.{module_name}")
        except (ImportError, NameError) as exc:  # NameError: its annotations name FastAPI classes
            raise ImportError(
                f"hf-prefix-cache serve needs transformers' serving extra (FastAPI, uvicorn): "
                f"pip install 'hf-prefix-cache[serve]' ({type(exc).__name__}: {exc})"
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
