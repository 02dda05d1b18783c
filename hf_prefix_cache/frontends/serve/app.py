"""The app: transformers' own OpenAI-compatible server, with a prefix store attached to every model it loads.

Built from transformers' classes (`transformers.cli.serving`), none copied: its `build_server`
makes the FastAPI app and its handlers answer every endpoint. Four subclasses change only what
the store needs:

- `StoreModelManager`: each model it loads gets a `PrefixCache(model, attach="all")`, dropped
  (saved to disk first, with a disk tier) when transformers unloads the model;
- `ScopedGenerationState`: hands out `ScopedGenerateManager`s (`requests.py`), never
  continuous batching, whose paged cache a store cannot serve;
- the chat, text-completion, Responses and transcription handlers: each request runs in its own
  scope (salt in, ``cached_tokens`` out; see `requests.py`).

Beside transformers' routes: ``GET /v1/cache/stats`` (every store's `CacheStats`, budgets and pinned
nodes as JSON; ``?check=true`` adds its integrity check) and,
with `prometheus_client` installed, ``GET /metrics`` (`frontends/prometheus.py`, labelled by model).
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
from starlette.responses import Response
from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.model_manager import ModelManager
from transformers.cli.serving.response import ResponseHandler
from transformers.cli.serving.server import build_server
from transformers.cli.serving.systemone import SystemOneHandler
from transformers.cli.serving.transcription import TranscriptionHandler
from transformers.cli.serving.utils import GenerationState

from hf_prefix_cache._compat import LISTS_FORCED_MODEL
from hf_prefix_cache.api.prefix_cache import PrefixCache, store_of
from hf_prefix_cache.frontends.serve.requests import SaltHeader, ScopedGenerateManager, scoped_request

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
    """

    model: str | None = None
    store: dict[str, Any] | None = field(default_factory=dict)
    device: str = "auto"
    dtype: str | None = "auto"
    model_timeout: int = 300
    enable_cors: bool = False


@dataclass(frozen=True, slots=True)
class ServedModel:
    """A loaded model and its store."""

    model_id: str
    store: PrefixCache


class StoreModelManager(ModelManager):
    """transformers' `ModelManager`; every model it loads gets a store, dropped when the model is unloaded."""

    def __init__(self, store_options: dict[str, Any] | None, **kwargs: Any) -> None:
        self._store_options = store_options
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
        logger.warning("prefix store attached to %s: budgets %s", model_id, store.budgets)
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

    if not LISTS_FORCED_MODEL:

        def get_gen_models(self, cache_dir: str | None = None) -> list[dict[str, Any]]:
            """5.23's `/v1/models` (see `_compat`): the forced model alone, else the hub cache's models."""
            if self.force_model is not None:
                return [{"id": self.force_model, "object": "model", "created": 0, "owned_by": "local"}]
            try:
                return list(super().get_gen_models(cache_dir))  # type: ignore[misc]
            except Exception:  # no hub cache at all (huggingface_hub.CacheNotFound): nothing to list
                return []


class ScopedGenerationState(GenerationState):
    """transformers' `GenerationState`, with one `ScopedGenerateManager` per model and no continuous batching."""

    def __init__(self) -> None:
        super().__init__(continuous_batching=False, compile=False)
        self._managers: dict[str, ScopedGenerateManager] = {}
        self._managers_lock = threading.Lock()

    def get_manager(self, model_id: str, use_cb: bool = False) -> Any:
        assert not use_cb, "continuous batching is off in this server"
        with self._managers_lock:
            manager = self._managers.get(model_id)
            if manager is None:
                manager = self._managers[model_id] = ScopedGenerateManager()  # type: ignore[no-untyped-call]
            return manager


class ScopedChatHandler(ChatCompletionHandler):
    """``/v1/chat/completions``, each request in its own scope."""

    async def handle_request(self, body: dict[str, Any], request_id: str) -> Any:
        return await scoped_request(super().handle_request, body, request_id)


class ScopedCompletionHandler(CompletionHandler):
    """``/v1/completions``, each request in its own scope."""

    async def handle_request(self, body: dict[str, Any], request_id: str) -> Any:
        return await scoped_request(super().handle_request, body, request_id)


class ScopedResponseHandler(ResponseHandler):
    """``/v1/responses``, each request in its own scope."""

    async def handle_request(self, body: dict[str, Any], request_id: str) -> Any:
        return await scoped_request(super().handle_request, body, request_id)


class ScopedTranscriptionHandler(TranscriptionHandler):
    """``/v1/audio/transcriptions``, each request in its own scope (salted by the header only: the body is a form)."""

    async def handle_request(self, request: Request) -> Any:
        async def handle(_body: dict[str, Any], _request_id: str) -> Response:
            return await super(ScopedTranscriptionHandler, self).handle_request(request)

        return await scoped_request(handle, {}, "")


def build_app(options: ServeOptions) -> tuple[FastAPI, StoreModelManager]:
    """transformers' app for `options`, with stores; loads a forced model now.

    Returns:
        The FastAPI app (run it with uvicorn) and its model manager (`served()` lists the stores).

    Example:
        >>> app, models = build_app(ServeOptions(model="path/to/model", store={"max_bytes": "1GB"}))  # doctest: +SKIP
    """
    models = StoreModelManager(
        options.store,
        device=options.device,
        dtype=options.dtype,
        trust_remote_code=False,
        attn_implementation=None,
        model_timeout=options.model_timeout,
        force_model=options.model,
    )
    state = ScopedGenerationState()
    app: FastAPI = build_server(
        models,
        ScopedChatHandler(model_manager=models, generation_state=state, chat_template_kwargs={}),
        completion_handler=ScopedCompletionHandler(model_manager=models, generation_state=state),
        response_handler=ScopedResponseHandler(model_manager=models, generation_state=state, chat_template_kwargs={}),
        transcription_handler=ScopedTranscriptionHandler(model_manager=models, generation_state=state),
        systemone_handler=SystemOneHandler(
            model_manager=models, generation_state=state, chat_template_kwargs={}, decision_config=None
        ),
        generation_state=state,
        enable_cors=options.enable_cors,
    )
    app.add_middleware(SaltHeader)

    @app.get("/v1/cache/stats")
    def cache_stats(check: bool = False) -> JSONResponse:
        """Every store's stats, budgets and pinned nodes; ``?check=true`` also runs its integrity check."""
        return JSONResponse({"object": "list", "data": [_describe(s, check) for s in models.served()]})

    metrics = _metrics(models)
    if metrics is not None:

        @app.get("/metrics")
        def prometheus_metrics() -> PlainTextResponse:
            text, content_type = metrics()
            return PlainTextResponse(text, media_type=content_type)

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


def _metrics(models: StoreModelManager) -> Any:
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
