"""A store's stats as the API servers show them: JSON for ``/v1/cache/stats``, Prometheus text for ``/metrics``.

`describe` and `store_metrics` run in the model's process, where the store is (`engine.py`);
`merge_metrics` runs in the API server, joining the texts of every model's process and its own
into one exposition (a family named by several processes becomes one, its samples kept apart by
their ``model`` label).

>>> print(merge_metrics(['# HELP a_total x\\n# TYPE a_total counter\\na_total{model="m"} 1.0\\n']), end="")
# HELP a_total x
# TYPE a_total counter
a_total{model="m"} 1.0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any


def describe(model_id: str, store: Any, check: bool) -> dict[str, Any]:
    """A store's stats, budgets and pinned nodes (and, with `check`, its integrity check's verdict)."""
    from hf_prefix_cache.api.prefix_cache import store_of

    described: dict[str, Any] = {
        "model": model_id,
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


def store_metrics(model_id: str, store: Any) -> str:
    """The store's metrics (`frontends/prometheus.py`), labelled with its model, in Prometheus' text format ("" without
    `prometheus_client`)."""
    try:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.core import Metric

        from hf_prefix_cache.frontends.prometheus import StoreCollector
    except ImportError:
        return ""

    class Labelled:
        def collect(self) -> Iterator[Any]:
            for family in StoreCollector(store).collect():
                out = Metric(family.name, family.documentation, family.type)
                for sample in family.samples:
                    out.add_sample(sample.name, {**sample.labels, "model": model_id}, sample.value)
                yield out

    registry = CollectorRegistry()
    registry.register(Labelled())
    return bytes(generate_latest(registry)).decode("utf-8")


def merge_metrics(texts: Iterable[str]) -> str:
    """Prometheus texts joined into one: each family once, with every text's samples of it."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    merged: dict[str, Any] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            known = merged.get(family.name)
            if known is None:
                merged[family.name] = family
            else:
                known.samples.extend(family.samples)

    class Merged:
        def collect(self) -> Iterator[Any]:
            yield from merged.values()

    registry = CollectorRegistry()
    registry.register(Merged())
    return bytes(generate_latest(registry)).decode("utf-8")
