"""The app: transformers' own OpenAI-compatible server, with a prefix store beside every model it runs.

Built from transformers' classes (`transformers.cli.serving`, 5.25's engine architecture), none
copied: its `build_server` makes the FastAPI app and its handlers answer every endpoint. Each model
runs in a process of its own (the engine); the API server tokenizes, sends it requests and reads
back tokens. Subclasses change only what the store and an operator need:

- `engine.StoreLoader`: the loader pickled into each model's process; the model it loads gets a
  `PrefixCache(model, attach="all")`, saved (with a disk tier) when the process is stopped;
- `client.StoreModelManager` and `client.ScopedEngineClient`: every request crosses to the model's
  process with its tenant, salt and deadline, and ``cached_tokens`` and its timings come back;
  `/v1/models` lists the forced model under its served name;
- the chat, text-completion, Responses and transcription handlers: each request is parsed and
  checked off the event loop (`bodies.py`, `validate.py`) and runs as a request of its own
  (see `requests.py`).

Around them, ASGI middlewares (outermost first): requests counted by status (`metrics.py`),
keys and tenants (`access.py`), the body limit and admission (`limits.py`), the salt header.
Beside transformers' routes: ``GET /v1/cache/stats`` (every running store's `CacheStats`, budgets
and pinned nodes as JSON, ``?check=true`` adds its integrity check; a tenant sees only its own
counters) and ``GET /metrics`` (the stores' metrics, `frontends/prometheus.py`, and the requests',
`metrics.py`; needs `prometheus_client`, in the serve extra). Both are asked of the models'
processes over their query channels (`engine.Channel`), beside generation.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException
from starlette.responses import Response
from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.response import ResponseHandler
from transformers.cli.serving.server import build_server
from transformers.cli.serving.systemone import SystemOneHandler
from transformers.cli.serving.transcription import TranscriptionHandler
from transformers.cli.serving.utils import GenerationState, Modality

from hf_prefix_cache.batching.cpu_linear import Choice
from hf_prefix_cache.frontends.serve.access import Access, AccessMiddleware, current_caller
from hf_prefix_cache.frontends.serve.batched import BatchOptions
from hf_prefix_cache.frontends.serve.bodies import parse_off_loop
from hf_prefix_cache.frontends.serve.client import StoreModelManager
from hf_prefix_cache.frontends.serve.engine import StoreLoader
from hf_prefix_cache.frontends.serve.errors import error_response, http_exception_handler, value_error_handler
from hf_prefix_cache.frontends.serve.limits import Admission, BodyLimit
from hf_prefix_cache.frontends.serve.metrics import ServeMetrics, StatusRecorder
from hf_prefix_cache.frontends.serve.requests import ModelNames, SaltHeader, scoped_request
from hf_prefix_cache.frontends.serve.stats import merge_metrics
from hf_prefix_cache.frontends.serve.validate import (
    TEXT_PARTS,
    RequestError,
    check_chat,
    check_completion,
    check_response,
    check_text,
)
from hf_prefix_cache.frontends.serve_args import (
    DEFAULT_MAX_BATCH_ROWS,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUED,
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_REQUEST_TIMEOUT,
)

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
        api_servers: API server processes sharing the forced model's process (``--api-server-count``).
        batch: decode the requests in flight together where the model's process has a store (`batched.py`);
            False: one ``generate`` at a time, as transformers serve.
        max_batch_rows: at most this many requests decode together.
        prefill_chunk: a request with more uncached prompt tokens is prefilled this many at a time (0: whole).
        pack_joins: a request joins in the running requests' own forward where the model allows it.
        cpu_linear: the kernel of the model's float32 CPU linear layers where it has a store (``auto``, ``prepacked``,
            ``onednn``, ``torch``: `batching.cpu_linear`).
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
    api_servers: int = 1
    batch: bool = True
    max_batch_rows: int = DEFAULT_MAX_BATCH_ROWS
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    pack_joins: bool = True
    cpu_linear: Choice = "auto"

    def loader(self) -> StoreLoader:
        """The loader each model's process gets (its store's and batching's options; no query channel yet)."""
        batch = None
        if self.batch:  # a runner thread for each request the API servers admit, and one to take the next
            batch = BatchOptions(
                self.max_batch_rows,
                max_runner_threads=self.max_queued * self.api_servers + 1,
                prefill_chunk=self.prefill_chunk,
                pack_joins=self.pack_joins,
            )
        return StoreLoader(self.store, batch=batch, cpu_linear=self.cpu_linear, device=self.device, dtype=self.dtype)


@dataclass(frozen=True, slots=True)
class RequestSettings:
    """What every handler applies to its requests: the model's names and the timeout."""

    names: ModelNames
    timeout: float | None


class _Scoped:
    """Mixed into each handler: check the body, then run transformers' handler as a request of its own."""

    settings: RequestSettings
    check: Any = None
    prompt_field = "messages"  # the field a prompt over the context is blamed on

    async def _scoped(self, handle: Any, body: dict[str, Any], request_id: str) -> Any:
        await asyncio.to_thread(self._check_body, body)  # off the event loop: a large body takes a while
        settings = self.settings
        return await scoped_request(handle, body, request_id, settings.names, settings.timeout)

    def _check_body(self, body: dict[str, Any]) -> None:
        check_text(body)
        if self.check is not None:
            self.check(body)

    def _check_prompt_length(self, engine: Any, inputs: dict[str, Any]) -> None:
        """transformers' check of the prompt against the context, as a 400 naming the field and both numbers."""
        from transformers.cli.serving.utils import prompt_length

        limit = engine.generation_state.context_length(engine.model_config)
        length = prompt_length(inputs)
        if limit is not None and length >= limit:
            raise RequestError(
                self.prompt_field,
                f"the prompt has {length} tokens; the model's context is {limit} tokens: shorten the prompt",
            )


class ScopedChatHandler(_Scoped, ChatCompletionHandler):
    """``/v1/chat/completions``, each request checked and in its own scope."""

    check = staticmethod(check_chat)

    async def handle_request(self, body: dict[str, Any], request_id: str) -> Any:
        return await self._scoped(super().handle_request, body, request_id)

    def _build_generation_kwargs(self, body: dict[str, Any], model_generation_config: Any) -> dict[str, Any]:
        """transformers' settings, with ``logit_bias``'s integer biases as floats (what `generate` takes; OpenAI's API
        takes both)."""
        kwargs = dict(super()._build_generation_kwargs(body, model_generation_config))
        if kwargs.get("sequence_bias"):
            kwargs["sequence_bias"] = {ids: float(bias) for ids, bias in kwargs["sequence_bias"].items()}
        return kwargs

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
    prompt_field = "prompt"

    async def handle_request(self, body: dict[str, Any], request_id: str) -> Any:
        return await self._scoped(super().handle_request, body, request_id)


class ScopedResponseHandler(_Scoped, ResponseHandler):
    """``/v1/responses``, each request checked and in its own scope."""

    check = staticmethod(check_response)
    prompt_field = "input"

    async def handle_request(self, body: dict[str, Any], request_id: str) -> Any:
        return await self._scoped(super().handle_request, body, request_id)


class ScopedTranscriptionHandler(_Scoped, TranscriptionHandler):
    """``/v1/audio/transcriptions``, each request in its own scope (salted by the header only: the body is a form)."""

    async def handle_request(self, request: Request) -> Any:
        async def handle(_body: dict[str, Any], _request_id: str) -> Response:
            return await super(ScopedTranscriptionHandler, self).handle_request(request)

        return await self._scoped(handle, {}, "")


def build_app(
    options: ServeOptions,
    loader: StoreLoader | None = None,
    engine_connection: tuple[Any, ...] | None = None,
    api_server: int = 0,
) -> tuple[FastAPI, StoreModelManager]:
    """transformers' app for `options`, with stores; starts the forced model's process now (or, with
    `engine_connection`, joins the one `supervisor.run_api_servers` started with `loader`).

    Returns:
        The FastAPI app (run it with uvicorn) and its model manager (`running()` lists the models' processes).

    Example:
        >>> app, models = build_app(ServeOptions(model="path/to/model", store={"max_bytes": "1GB"}))  # doctest: +SKIP
    """
    metrics = ServeMetrics()
    state = GenerationState(continuous_batching=False, compile=False)  # a paged cache no store can serve
    models = StoreModelManager(
        loader or options.loader(),
        metrics=metrics,
        served_name=options.served_name,
        api_server=api_server,
        generation_state=state,
        model_timeout=options.model_timeout,
        force_model=options.model,
        engine_connection=engine_connection,
    )
    settings = RequestSettings(ModelNames(options.served_name, options.model), options.request_timeout)
    common: dict[str, Any] = {"model_manager": models, "generation_state": state}
    handlers = (
        ScopedChatHandler(**common, chat_template_kwargs={}),
        ScopedCompletionHandler(**common),
        ScopedResponseHandler(**common, chat_template_kwargs={}),
        ScopedTranscriptionHandler(models),
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
        enable_cors=options.enable_cors,
    )
    parse_off_loop(
        app,
        {
            "/v1/chat/completions": chat.handle_request,
            "/v1/completions": completion.handle_request,
            "/v1/responses": response.handle_request,
        },
    )
    app.add_exception_handler(HTTPException, http_exception_handler)
    app.add_exception_handler(ValueError, value_error_handler)  # replaces transformers' {"detail": ...}
    app.add_middleware(SaltHeader)
    app.add_middleware(
        Admission, max_queued=options.max_queued, retry_after=metrics.retry_after, on_change=metrics.set_admitted
    )
    app.add_middleware(BodyLimit, max_bytes=options.max_body_bytes)
    app.add_middleware(AccessMiddleware, access=Access(options.keys, options.admin_key))
    app.add_middleware(StatusRecorder, metrics=metrics)  # added last: outermost, so it sees every answer

    @app.get("/v1/cache/stats")
    async def cache_stats(check: bool = False) -> JSONResponse:
        """Every running store's stats, budgets and pinned nodes (``?check=true``: integrity too); a tenant: its
        counters."""
        caller = current_caller()
        if not caller.is_admin:
            if check:
                return error_response(403, "the integrity check needs the admin key", "check")
            return JSONResponse(await asyncio.to_thread(_tenant_view, models, caller.tenant))
        described = await asyncio.to_thread(_ask_all, models, "stats", check)
        return JSONResponse({"object": "list", "data": [d for d in described if d is not None]})

    if metrics.registry is not None:

        @app.get("/metrics")
        async def prometheus_metrics() -> PlainTextResponse:
            from prometheus_client import CONTENT_TYPE_LATEST

            texts = await asyncio.to_thread(_ask_all, models, "metrics", None)
            return PlainTextResponse(merge_metrics([*texts, metrics.render()]), media_type=CONTENT_TYPE_LATEST)

    return app, models


def _ask_all(models: StoreModelManager, kind: str, arg: Any) -> list[Any]:
    """Every running model's process's answer to a query (a process that stopped meanwhile is left out)."""
    answers = []
    for _, asker in models.running():
        try:
            answers.append(asker.ask(kind, arg))
        except TimeoutError:
            logger.warning("a model's process did not answer %s", kind)
    return answers


def _tenant_view(models: StoreModelManager, tenant: str | None) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for counters in _ask_all(models, "tenant", tenant):
        merged.update(counters)
    return {"object": "tenant.stats", "tenant": tenant, "models": merged}
