"""What the server measures of its requests, for ``/metrics`` (Prometheus) and each tenant's ``/v1/cache/stats``.

Recorded as requests happen: the jobs' latencies and tokens in the model's process
(`JobMetrics`, beside the store, one for every API server), answers and queue gauges in each API
server (`ServeMetrics`); the stores' own counters are read at each scrape (`frontends/prometheus.py`).
Metric names, all prefixed ``hf_prefix_cache_serve_``:

| name | type | labels |
|---|---|---|
| `requests_total` | counter | `endpoint`, `status`, `tenant` |
| `time_to_first_token_seconds` | histogram | `model`, `tenant` |
| `request_seconds` (arrival to the last token) | histogram | `model`, `tenant` |
| `queue_seconds` (arrival to the start of its `generate`) | histogram | `model` |
| `generated_tokens_per_second` (decode rate, per request) | histogram | `model`, `tenant` |
| `prompt_tokens_total`, `cached_tokens_total`, `generated_tokens_total` | counter | `model`, `tenant` |
| `reused_token_ratio` (cached over prompt tokens, so far) | gauge | `model`, `tenant` |
| `cancelled_total` (client gone; its prompt is still stored) | counter | `model`, `tenant` |
| `admitted` (queued or generating), `queued`, `running` (each API server's own) | gauge | |

The tenant label is the key's tenant, ``-`` for the operator (no keys, or the admin key).
Without `prometheus_client` only the tenants' JSON counters are kept.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hf_prefix_cache.frontends.serve.limits import GENERATION_PATHS

PREFIX = "hf_prefix_cache_serve"
NO_TENANT = "-"
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600)
_RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


@dataclass(slots=True)
class TenantCounters:
    """One tenant's requests and tokens on one model (what a tenant sees of the stats)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    cancelled: int = 0


@dataclass(frozen=True, slots=True)
class Finished:
    """One generation job's numbers, as the model's process reports them (`engine.py`)."""

    model: str
    tenant: str | None
    arrival: float
    started: float
    first_token_at: float | None
    ended: float
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    cancelled: bool


class JobMetrics:
    """What the model's process measures of the jobs it runs, for every API server at once.

    Lives in the engine process beside the store (`engine.py`): each job's `Finished` is recorded
    there, so with ``--api-server-count N`` the histograms and each tenant's counters cover every
    API server's requests. `render` answers the job part of a scrape (None-safe without `prometheus_client`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tenants: dict[tuple[str, str], TenantCounters] = {}
        try:
            import prometheus_client as prom
        except ImportError:
            self.registry: Any = None
            return
        self.registry = registry = prom.CollectorRegistry()
        mt = ["model", "tenant"]

        def histogram(name: str, doc: str, labels: list[str], buckets: tuple[float, ...]) -> Any:
            return prom.Histogram(f"{PREFIX}_{name}", doc, labels, buckets=buckets, registry=registry)

        def counter(name: str, doc: str, labels: list[str]) -> Any:
            return prom.Counter(f"{PREFIX}_{name}", doc, labels, registry=registry)

        self._ttft = histogram(
            "time_to_first_token_seconds", "arrival to the first generated token", mt, _LATENCY_BUCKETS
        )
        self._e2e = histogram("request_seconds", "arrival to the last generated token", mt, _LATENCY_BUCKETS)
        self._queue = histogram("queue_seconds", "arrival to the start of generate", ["model"], _LATENCY_BUCKETS)
        self._rate = histogram("generated_tokens_per_second", "decode rate of each request", mt, _RATE_BUCKETS)
        self._prompt = counter("prompt_tokens", "prompt tokens of generation requests", mt)
        self._cached = counter("cached_tokens", "prompt tokens restored from the store", mt)
        self._generated = counter("generated_tokens", "tokens generated", mt)
        self._cancelled = counter("cancelled", "requests whose client left before the answer ended", mt)
        self._ratio = prom.Gauge(
            f"{PREFIX}_reused_token_ratio", "cached over prompt tokens so far", mt, registry=registry
        )

    def record(self, done: Finished) -> None:
        """A job that ran (one past its deadline before it started is not recorded)."""
        with self._lock:
            tenant = done.tenant or NO_TENANT
            counts = self._tenants.setdefault((done.model, tenant), TenantCounters())
            counts.requests += 1
            counts.prompt_tokens += done.prompt_tokens
            counts.cached_tokens += done.cached_tokens
            counts.generated_tokens += done.generated_tokens
            counts.cancelled += int(done.cancelled)
            ratio = counts.cached_tokens / counts.prompt_tokens if counts.prompt_tokens else 0.0
        if self.registry is None:
            return
        labels = (done.model, tenant)
        self._queue.labels(done.model).observe(done.started - done.arrival)
        self._e2e.labels(*labels).observe(done.ended - done.arrival)
        if done.first_token_at is not None:
            self._ttft.labels(*labels).observe(done.first_token_at - done.arrival)
            decode = done.ended - done.first_token_at
            if done.generated_tokens > 1 and decode > 0:
                self._rate.labels(*labels).observe((done.generated_tokens - 1) / decode)
        self._prompt.labels(*labels).inc(done.prompt_tokens)
        self._cached.labels(*labels).inc(done.cached_tokens)
        self._generated.labels(*labels).inc(done.generated_tokens)
        if done.cancelled:
            self._cancelled.labels(*labels).inc()
        self._ratio.labels(*labels).set(ratio)

    def tenant_view(self, tenant: str | None) -> dict[str, Any]:
        """What `tenant` may see: its own counters, per model."""
        name = tenant or NO_TENANT
        with self._lock:
            models = {model: asdict(c) for (model, t), c in self._tenants.items() if t == name}
        return {"object": "tenant.stats", "tenant": tenant, "models": models}

    def render(self) -> str:
        """The job metrics in Prometheus' text format ("" without `prometheus_client`)."""
        if self.registry is None:
            return ""
        from prometheus_client import generate_latest

        return bytes(generate_latest(self.registry)).decode("utf-8")


class ServeMetrics:
    """What one API server measures: answers by status, requests admitted, jobs queued and running, Retry-After.

    The jobs' own latencies and token counts are measured in the model's process (`JobMetrics`);
    a scrape of ``/metrics`` joins the two (`app.py`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._recent: deque[float] = deque(maxlen=32)  # request seconds, for Retry-After
        self.queued = 0
        self.running = 0
        try:
            import prometheus_client as prom
        except ImportError:
            self.registry: Any = None
            return
        self.registry = registry = prom.CollectorRegistry()
        self._requests = prom.Counter(
            f"{PREFIX}_requests",
            "HTTP requests answered, by endpoint and status",
            ["endpoint", "status", "tenant"],
            registry=registry,
        )
        self._admitted = prom.Gauge(f"{PREFIX}_admitted", "generation requests queued or generating", registry=registry)
        prom.Gauge(f"{PREFIX}_queued", "jobs waiting for the model's process", registry=registry).set_function(
            lambda: self.queued
        )
        prom.Gauge(f"{PREFIX}_running", "jobs generating now", registry=registry).set_function(lambda: self.running)

    # ------------------------------------------------------------ recording
    def set_admitted(self, n: int) -> None:
        """The number of generation requests admitted (queued or generating)."""
        if self.registry is not None:
            self._admitted.set(n)

    def job_queued(self) -> None:
        """A job was sent to the model's process."""
        with self._lock:
            self.queued += 1

    def job_started(self) -> None:
        """A job sent began to run."""
        with self._lock:
            self.queued -= 1
            self.running += 1

    def job_left(self, started: bool, seconds: float | None = None) -> None:
        """A job ended (`started`: it ran; `seconds`: arrival to end, for Retry-After), or left the queue unrun."""
        with self._lock:
            if started:
                self.running -= 1
            else:
                self.queued -= 1
            if seconds is not None:
                self._recent.append(seconds)

    def answered(self, endpoint: str, status: int, tenant: str | None) -> None:
        """Count one answer."""
        if self.registry is not None:
            self._requests.labels(endpoint, str(status), tenant or NO_TENANT).inc()

    # ------------------------------------------------------------ reading
    def retry_after(self) -> float:
        """The mean seconds of recent requests (1 before any): how long a refused client should wait."""
        with self._lock:
            return sum(self._recent) / len(self._recent) if self._recent else 1.0

    def render(self) -> str:
        """This API server's metrics in Prometheus' text format ("" without `prometheus_client`)."""
        if self.registry is None:
            return ""
        from prometheus_client import generate_latest

        return bytes(generate_latest(self.registry)).decode("utf-8")


class StatusRecorder:
    """ASGI middleware: counts each answered request by endpoint (the generation paths, else ``other``) and status."""

    def __init__(self, app: ASGIApp, metrics: ServeMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        from hf_prefix_cache.frontends.serve.access import current_caller

        status = 500
        tenant: list[str | None] = [None]

        async def recording(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                tenant[0] = current_caller().tenant
            await send(message)

        try:
            await self.app(scope, receive, recording)
        finally:
            path = scope["path"] if scope["path"] in GENERATION_PATHS else "other"
            self.metrics.answered(path, status, tenant[0])


def now() -> float:
    """The clock every timing here uses."""
    return time.monotonic()
