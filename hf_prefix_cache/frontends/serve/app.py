"""The app: transformers' own OpenAI-compatible server, with a prefix store attached to every model it loads.

Built from transformers' classes (`transformers.cli.serving`), none copied: its `build_server`
makes the FastAPI app and its handlers answer every endpoint. Subclasses change only what the
store and an operator need:

- `StoreModelManager`: each model it loads gets a `PrefixCache(model, attach="all")`, dropped
  (saved to disk first, with a disk tier) when transformers unloads the model; `/v1/models`
  lists the forced model under its served name;
- `ScopedGenerationState`: hands out `generation.ScopedGenerateManager`s, never continuous
  batching, whose paged cache a store cannot serve;
- the chat, text-completion, Responses and transcription handlers: each request is checked
  (`validate.py`) and runs as a request of its own (tenant and salt in, ``cached_tokens`` out;
  see `requests.py`).

Around them, ASGI middlewares (outermost first): requests counted by status (`metrics.py`),
keys and tenants (`access.py`), the body limit and admission (`limits.py`), the salt header.
Beside transformers' routes: ``GET /v1/cache/stats`` (every store's `CacheStats`, budgets and
pinned nodes as JSON, ``?check=true`` adds its integrity check; a tenant sees only its own
counters) and ``GET /metrics`` (the stores' metrics, `frontends/prometheus.py`, and the requests',
`metrics.py`; needs `prometheus_client`, in the serve extra).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException
from starlette.responses import Response
from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.model_manager import ModelManager
from transformers.cli.serving.response import ResponseHandler
from transformers.cli.serving.server import build_server
from transformers.cli.serving.systemone import SystemOneHandler
from transformers.cli.serving.transcription import TranscriptionHandler
from transformers.cli.serving.utils import GenerationState, Modality

from hf_prefix_cache._compat import LISTS_FORCED_MODEL
from hf_prefix_cache.api.prefix_cache import PrefixCache, store_of
from hf_prefix_cache.frontends.serve.access import Access, AccessMiddleware, current_caller
from hf_prefix_cache.frontends.serve.errors import error_response, http_exception_handler
from hf_prefix_cache.frontends.serve.generation import ScopedGenerateManager
from hf_prefix_cache.frontends.serve.limits import Admission, BodyLimit
from hf_prefix_cache.frontends.serve.metrics import ServeMetrics, StatusRecorder
from hf_prefix_cache.frontends.serve.requests import ModelNames, SaltHeader, scoped_request
from hf_prefix_cache.frontends.serve.validate import (
    TEXT_PARTS,
    RequestError,
    check_chat,
    check_completion,
    check_response,
)
from hf_prefix_cache.frontends.serve_args import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUED, DEFAULT_REQUEST_TIMEOUT

logger = logging.getLogger("hf_prefix_cache")


@dataclass(slots=True)
class ServeOptions:
    """How to serve: the model, transformers' server settings, and the keyword arguments of every model's store.

    Attributes:
        model: the forced model (a local folder or a hub id); None serves what requests name.
        store: `PrefixCache` keyword arguments (budgets, ``disk_dir``, ``remote``, ``salt``, ...);
            None serves without a store (transformers' server as shipped, for comparisons).
        device, dtype, model_timeout: as ``transformers serve`` takes them.
        enable_cors: permissive CORS, as ``transformers serve --enable-cors``.
        served_name: the name clients use for the forced model (None: its path or hub id).
        keys: each client API key's tenant (empty, with no `admin_key`: no keys needed).
        admin_key: the key of ``/metrics``, the full stats and the integrity check.
        max_body_bytes, max_queued, request_timeout: the limits (`limits.py`; timeout in seconds, None: none).
    """

    model: str | None = None
    store: dict[str, Any] | None = field(default_factory=dict)
    device: str = "auto"
    dtype: str | None = "auto"
    model_timeout: int = 300
    enable_cors: bool = False
    served_name: str | None = None
    keys: dict[str, str] = field(default_factory=dict)
    admin_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_queued: int = DEFAULT_MAX_QUEUED
    request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT


@dataclass(frozen=True, slots=True)
class ServedModel:
    """A loaded model and its store."""

    model_id: str
    store: PrefixCache


class StoreModelManager(ModelManager):
    """transformers' `ModelManager`; every model it loads gets a store, dropped when the model is unloaded."""

    def __init__(self, store_options: dict[str, Any] | None, served_name: str | None = None, **kwargs: Any) -> None:
        self._store_options = store_options
        self.served_name = served_name
        self._served: dict[int, ServedModel] = {}
        self._served_lock = threading.Lock()
        super().__init__(**kwargs)  # loads a forced model now, through load_model_and_processor below

    def load_model_and_processor(self, model_id_and_revision: str, *args: Any, **kwargs: Any) -> Any:
        model, processor = super().load_model_and_processor(model_id_and_revision, *args, **kwargs)
        if self._store_options is not None:
            with self._served_lock:
                if id(model) not in self._served:
                    self._attach(model_id_and_revision, model)
        return model, processor

    def _attach(self, model_id: str, model: Any) -> None:
        store = PrefixCache(model, attach="all", **self._store_options)  # type: ignore[arg-type]
        self._served[id(model)] = ServedModel(model_id, store)
        logger.info("prefix store attached to %s: budgets %s", model_id, store.budgets)
        for timed in list(self.loaded_models.values()):
            if timed.model is model:
                unload = timed.delete_model

                def delete_model(unload: Any = unload, key: int = id(model)) -> None:
                    self._drop(key)
                    unload()

                timed.delete_model = delete_model  # type: ignore[method-assign]

    def _drop(self, key: int) -> None:
        with self._served_lock:
            served = self._served.pop(key, None)
        if served is None:
            return
        if served.store.budgets.get("disk"):
            served.store.save()  # what a restart should find again
        served.store.detach()

    def served(self) -> list[ServedModel]:
        """The loaded models and their stores."""
        with self._served_lock:
            return list(self._served.values())

    def _forced_listing(self) -> list[dict[str, Any]]:
        name = self.served_name or self.force_model
        return [{"id": name, "object": "model", "created": 0, "owned_by": "local"}]

    if LISTS_FORCED_MODEL:

        def list_models(self, cache_dir: str | None = None) -> list[dict[Any, Any]]:
            """`/v1/models`: the forced model under its served name, else transformers' listing."""
            if self.force_model is not None:
                return self._forced_listing()
            return list(super().list_models(cache_dir))

    else:

        def get_gen_models(self, cache_dir: str | None = None) -> list[dict[str, Any]]:
            """5.23's `/v1/models` (see `_compat`): the forced model alone (its served name), else the hub cache's."""
            if self.force_model is not None:
                return self._forced_listing()
            try:
                return list(super().get_gen_models(cache_dir))  # type: ignore[misc]
            except Exception:  # no hub cache at all (huggingface_hub.CacheNotFound): nothing to list
                return []


class ScopedGenerationState(GenerationState):
    """transformers' `GenerationState`, with one `ScopedGenerateManager` per model and no continuous batching."""

    def __init__(self, metrics: ServeMetrics | None = None) -> None:
        super().__init__(continuous_batching=False, compile=False)
        self.metrics = metrics
        self._managers: dict[str, ScopedGenerateManager] = {}
        self._managers_lock = threading.Lock()

    def get_manager(self, model_id: str, use_cb: bool = False) -> Any:
        assert not use_cb, "continuous batching is off in this server"
        with self._managers_lock:
            manager = self._managers.get(model_id)
            if manager is None:
                manager = self._managers[model_id] = ScopedGenerateManager(self.metrics)
            return manager


@dataclass(frozen=True, slots=True)
class RequestSettings:
    """What every handler applies to its requests: the model's names and the timeout."""

    names: ModelNames
    timeout: float | None


class _Scoped:
    """Mixed into each handler: check the body, then run transformers' handler as a request of its own."""

    settings: RequestSettings
    check: Any = None

    async def _scoped(self, handle: Any, body: dict[str, Any], request_id: str) -> Any:
        if self.check is not None:
            self.check(body)
        settings = self.settings
        return await scoped_request(handle, body, request_id, settings.names, settings.timeout)


class ScopedChatHandler(_Scoped, ChatCompletionHandler):
    """``/v1/chat/completions``, each request checked and in its own scope."""

    check = staticmethod(check_chat)

    async def handle_request(self, body: dict[str, Any], request_id: str) -> Any:
        return await self._scoped(super().handle_request, body, request_id)

    def get_processor_inputs_from_messages(self, messages: list[dict[str, Any]], modality: Any) -> list[dict[str, Any]]:  # type: ignore[override]
        """transformers' conversion, refusing media parts a text-only model would drop without a word."""
        if modality == Modality.LLM:
            for i, message in enumerate(messages):
                content = message.get("content")
                for j, part in enumerate(content if isinstance(content, list) else []):
                    if part.get("type") not in TEXT_PARTS:
                        raise RequestError(
                            f"messages[{i}].content[{j}].type",
                            f"messages[{i}].content[{j}].type must be text: this model reads text only; "
                            f"got {part.get('type')!r}",
                        )
        return list(ChatCompletionHandler.get_processor_inputs_from_messages(messages, modality))


class ScopedCompletionHandler(_Scoped, CompletionHandler):
    """``/v1/completions``, each request checked and in its own scope."""

    check = staticmethod(check_completion)

    async def handle_request(self, body: dict[str, Any], request_id: str) -> Any:
        return await self._scoped(super().handle_request, body, request_id)


class ScopedResponseHandler(_Scoped, ResponseHandler):
    """``/v1/responses``, each request checked and in its own scope."""

    check = staticmethod(check_response)

    async def handle_request(self, body: dict[str, Any], request_id: str) -> Any:
        return await self._scoped(super().handle_request, body, request_id)


class ScopedTranscriptionHandler(_Scoped, TranscriptionHandler):
    """``/v1/audio/transcriptions``, each request in its own scope (salted by the header only: the body is a form)."""

    async def handle_request(self, request: Request) -> Any:
        async def handle(_body: dict[str, Any], _request_id: str) -> Response:
            return await super(ScopedTranscriptionHandler, self).handle_request(request)

        return await self._scoped(handle, {}, "")


def build_app(options: ServeOptions) -> tuple[FastAPI, StoreModelManager]:
    """transformers' app for `options`, with stores; loads a forced model now.

    Returns:
        The FastAPI app (run it with uvicorn) and its model manager (`served()` lists the stores).

    Example:
        >>> app, models = build_app(ServeOptions(model="path/to/model", store={"max_bytes": "1GB"}))  # doctest: +SKIP
    """
    models = StoreModelManager(
        options.store,
        served_name=options.served_name,
        device=options.device,
        dtype=options.dtype,
        trust_remote_code=False,
        attn_implementation=None,
        model_timeout=options.model_timeout,
        force_model=options.model,
    )
    metrics = ServeMetrics()
    state = ScopedGenerationState(metrics)
    settings = RequestSettings(ModelNames(options.served_name, options.model), options.request_timeout)
    common: dict[str, Any] = {"model_manager": models, "generation_state": state}
    handlers = (
        ScopedChatHandler(**common, chat_template_kwargs={}),
        ScopedCompletionHandler(**common),
        ScopedResponseHandler(**common, chat_template_kwargs={}),
        ScopedTranscriptionHandler(**common),
    )
    for handler in handlers:
        handler.settings = settings
    chat, completion, response, transcription = handlers
    app: FastAPI = build_server(
        models,
        chat,
        completion_handler=completion,
        response_handler=response,
        transcription_handler=transcription,
        systemone_handler=SystemOneHandler(**common, chat_template_kwargs={}, decision_config=None),
        generation_state=state,
        enable_cors=options.enable_cors,
    )
    app.add_exception_handler(HTTPException, http_exception_handler)
    app.add_middleware(SaltHeader)
    app.add_middleware(
        Admission, max_queued=options.max_queued, retry_after=metrics.retry_after, on_change=metrics.set_admitted
    )
    app.add_middleware(BodyLimit, max_bytes=options.max_body_bytes)
    app.add_middleware(AccessMiddleware, access=Access(options.keys, options.admin_key))
    app.add_middleware(StatusRecorder, metrics=metrics)  # added last: outermost, so it sees every answer

    @app.get("/v1/cache/stats")
    def cache_stats(check: bool = False) -> JSONResponse:
        """Every store's stats, budgets and pinned nodes (``?check=true``: integrity too); a tenant: its counters."""
        caller = current_caller()
        if not caller.is_admin:
            if check:
                return error_response(403, "the integrity check needs the admin key", "check")
            return JSONResponse(metrics.tenant_view(caller.tenant))
        return JSONResponse({"object": "list", "data": [_describe(s, check) for s in models.served()]})

    stores = _store_metrics(models)
    if stores is not None and metrics.registry is not None:

        @app.get("/metrics")
        def prometheus_metrics() -> PlainTextResponse:
            text, content_type = stores()
            return PlainTextResponse(text + metrics.render().decode("utf-8"), media_type=content_type)

    return app, models


def _describe(served: ServedModel, check: bool) -> dict[str, Any]:
    store = served.store
    described = {
        "model": served.model_id,
        "stats": dataclasses.asdict(store.stats()),
        "budgets": store.budgets,
        "pinned_nodes": store_of(store).num_pinned_nodes(),
    }
    if check:
        try:
            store.check_integrity()
            described["integrity"] = "ok"
        except RuntimeError as exc:
            described["integrity"] = str(exc)
    return described


def _store_metrics(models: StoreModelManager) -> Any:
    """A function answering a Prometheus scrape with every store's metrics (labelled by model), or None without
    `prometheus_client`."""
    try:
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
        from prometheus_client.core import Metric

        from hf_prefix_cache.frontends.prometheus import StoreCollector
    except ImportError:
        return None

    class ServedCollector:
        def collect(self) -> Iterator[Any]:
            merged: dict[str, Any] = {}
            for served in models.served():
                for family in StoreCollector(served.store).collect():
                    out = merged.get(family.name)
                    if out is None:
                        out = merged[family.name] = Metric(family.name, family.documentation, family.type)
                    for sample in family.samples:
                        out.add_sample(sample.name, {**sample.labels, "model": served.model_id}, sample.value)
            yield from merged.values()

    registry = CollectorRegistry()
    registry.register(ServedCollector())

    def scrape() -> tuple[str, str]:
        return generate_latest(registry).decode("utf-8"), CONTENT_TYPE_LATEST

    return scrape
