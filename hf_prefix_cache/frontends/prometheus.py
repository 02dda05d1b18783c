"""Prometheus metrics for a store, read from `stats()` at each scrape (needs `prometheus_client`).

Install: ``pip install prometheus_client`` (or ``pip install -e '.[metrics]'`` in a clone).
Nothing in the package imports this module; an app calls `register_metrics` once.

Metric names (the prefix defaults to ``hf_prefix_cache``):

| name | type | labels |
|---|---|---|
| `<prefix>_requests_total` | counter | |
| `<prefix>_hit_requests_total` | counter | |
| `<prefix>_prompt_tokens_total` | counter | |
| `<prefix>_hit_tokens_total` | counter | `modality` (text, image, video, audio) |
| `<prefix>_saved_prefill_flops_total` | counter | (an estimate, see `observe.py`) |
| `<prefix>_fallbacks_total` | counter | `reason` |
| `<prefix>_evictions_total`, `_offloads_total`, `_reloads_total`, `_failed_moves_total` | counter | |
| `<prefix>_bytes` | gauge | `tier` (device, host, disk) |
| `<prefix>_max_bytes` | gauge | `tier` (0: the tier is off) |
| `<prefix>_entries` | gauge | |
| `<prefix>_hit_rate` | gauge | share of prompt tokens reused |
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

try:
    from prometheus_client import REGISTRY
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
except ImportError as exc:  # pragma: no cover - exercised only without the package
    raise ImportError(
        "hf_prefix_cache.frontends.prometheus needs prometheus_client: pip install prometheus_client "
        "(or pip install -e '.[metrics]' in a clone of hf-prefix-cache)"
    ) from exc

if TYPE_CHECKING:
    from hf_prefix_cache.api.prefix_cache import PrefixCache


class StoreCollector:
    """A Prometheus collector reporting one store's stats under `prefix` at each scrape."""

    def __init__(self, store: PrefixCache, prefix: str = "hf_prefix_cache") -> None:
        self.store = store
        self.prefix = prefix

    def collect(self) -> Iterator[Any]:
        s = self.store.stats()
        p = self.prefix

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"{p}_{name}", doc, value=value)

        yield counter("requests", "generate requests through the store", s.requests)
        yield counter("hit_requests", "requests that reused a stored prefix", s.hit_requests)
        yield counter("prompt_tokens", "prompt tokens of all requests", s.prompt_tokens)
        hits = CounterMetricFamily(f"{p}_hit_tokens", "prompt tokens restored from the store", labels=["modality"])
        for modality, n in sorted(s.hit_tokens_by_modality.items()):
            hits.add_metric([modality], n)
        yield hits
        yield counter("saved_prefill_flops", "estimated prefill FLOPs spared by reuse", s.saved_prefill_flops)
        fallbacks = CounterMetricFamily(f"{p}_fallbacks", "requests run cold, by reason", labels=["reason"])
        for reason, n in sorted(s.fallbacks.items()):
            fallbacks.add_metric([reason], n)
        yield fallbacks
        yield counter("evictions", "nodes dropped from the store", s.evictions)
        yield counter("offloads", "nodes moved to a slower tier", s.offloads)
        yield counter("reloads", "nodes brought back to the device for a hit", s.reloads)
        yield counter("failed_moves", "moves to a slower tier that failed (the entry stayed)", s.failed_moves)
        used = GaugeMetricFamily(f"{p}_bytes", "bytes stored per tier", labels=["tier"])
        budget = GaugeMetricFamily(f"{p}_max_bytes", "byte budget per tier (0: off)", labels=["tier"])
        for tier, n, b in (
            ("device", s.device_nbytes, s.max_bytes),
            ("host", s.host_nbytes, s.max_host_bytes),
            ("disk", s.disk_nbytes, s.max_disk_bytes),
        ):
            used.add_metric([tier], n)
            budget.add_metric([tier], b)
        yield used
        yield budget
        yield GaugeMetricFamily(f"{p}_entries", "stored entries (leaves) over all tiers", value=s.entries)
        yield GaugeMetricFamily(f"{p}_hit_rate", "share of prompt tokens reused", value=s.hit_rate)


def register_metrics(store: PrefixCache, registry: Any = None, prefix: str = "hf_prefix_cache") -> StoreCollector:
    """Expose `store`'s stats as Prometheus metrics in `registry` (default: the global one).

    Args:
        store: the store to report.
        registry: a `prometheus_client.CollectorRegistry`; None uses `prometheus_client.REGISTRY`.
        prefix: the metric name prefix; give each store its own when registering several.

    Returns:
        The collector (pass it to `registry.unregister` to stop reporting).

    Example:
        >>> from prometheus_client import start_http_server           # doctest: +SKIP
        >>> register_metrics(store)                                   # doctest: +SKIP
        >>> start_http_server(9100)                                   # doctest: +SKIP
    """
    collector = StoreCollector(store, prefix)
    (REGISTRY if registry is None else registry).register(collector)
    return collector
