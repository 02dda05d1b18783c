"""What users see of the store's numbers: `CacheStats` (rendered as HTML in Jupyter) and byte sizes as text.

Pure string formatting of a stats snapshot (tiers, entries, bytes, hit rate, per-modality
hits, fallbacks) read from `stats()`; no Jupyter import, so the package needs no extra for it.
The store core knows nothing of it.
"""

from __future__ import annotations

import html
from dataclasses import fields

from hf_prefix_cache.store.stats import StoreStats

_TABLE = '<table style="border-collapse:collapse;font-size:0.9em">'
_CELL = 'style="padding:2px 8px;text-align:{align};border-bottom:1px solid #ddd"'


def format_nbytes(nbytes: int) -> str:
    """`nbytes` in the largest binary unit that keeps it at least 1 (``"1.5 MiB"``)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _table(header: list[str], rows: list[list[str]]) -> str:
    def row(cells: list[str], tag: str) -> str:
        return (
            "<tr>"
            + "".join(
                f"<{tag} {_CELL.format(align='left' if i == 0 else 'right')}>{html.escape(c)}</{tag}>"
                for i, c in enumerate(cells)
            )
            + "</tr>"
        )

    return _TABLE + row(header, "th") + "".join(row(r, "td") for r in rows) + "</table>"


def stats_html(stats: StoreStats) -> str:
    """The stats as HTML: requests and hit rate, one row per tier, hits by modality, fallbacks."""
    tiers: list[tuple[str, int, int]] = [
        ("device", stats.device_nbytes, stats.max_bytes),
        ("host", stats.host_nbytes, stats.max_host_bytes),
        ("disk", stats.disk_nbytes, stats.max_disk_bytes),
    ]
    tier_rows = [
        [
            name,
            format_nbytes(used),
            format_nbytes(budget) if budget else "off",
            f"{used / budget:.0%}" if budget else "-",
        ]
        for name, used, budget in tiers
    ]
    summary = [
        ["requests", f"{stats.requests} ({stats.hit_requests} hits)"],
        ["prompt tokens reused", f"{stats.hit_tokens} of {stats.prompt_tokens} ({stats.hit_rate:.1%})"],
        ["prefill saved (est.)", f"{stats.saved_prefill_flops / 1e9:.2f} GFLOP"],
        ["entries / nodes / snapshots", f"{stats.entries} / {stats.nodes} / {stats.snapshots}"],
        ["stored", format_nbytes(stats.nbytes)],
        ["evictions / offloads / reloads", f"{stats.evictions} / {stats.offloads} / {stats.reloads}"],
    ]
    parts = [
        "<div>",
        _table(["", ""], summary),
        "<b>tiers</b>",
        _table(["tier", "bytes", "budget", "use"], tier_rows),
    ]
    if stats.hit_tokens_by_modality:
        rows = [[k, str(v)] for k, v in sorted(stats.hit_tokens_by_modality.items())]
        parts += ["<b>reused tokens by modality</b>", _table(["modality", "tokens"], rows)]
    fallbacks = [[k, str(v)] for k, v in sorted(stats.fallbacks.items())]
    parts += ["<b>fallbacks</b>", _table(["reason", "count"], fallbacks) if fallbacks else "<p>none</p>", "</div>"]
    return "\n".join(parts)


def store_html(model: object, namespace: str, stats: StoreStats) -> str:
    """A store as HTML: its model and namespace, then its stats."""
    title = f"PrefixCache for {type(model).__name__}, namespace {namespace[:12]}"
    return f"<div><b>{html.escape(title)}</b>{stats_html(stats)}</div>"


class CacheStats(StoreStats):
    """Counters since the store was made (or `reset_stats`), plus its current size; Jupyter shows it as tables.

    The fields are those of `store.stats.StoreStats` (documented there). Example:

        >>> _ = model.generate(ids, cache=store, max_new_tokens=1)
        >>> stats = store.stats()
        >>> stats.requests, stats.hit_rate
        (1, 0.0)
        >>> "<table" in stats._repr_html_()
        True
    """

    __slots__ = ()

    def _repr_html_(self) -> str:
        return stats_html(self)


def shown(stats: StoreStats) -> CacheStats:
    """The user's view of a store's `stats` (the same fields)."""
    return CacheStats(**{f.name: getattr(stats, f.name) for f in fields(stats)})
