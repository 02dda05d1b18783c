"""Rich HTML for Jupyter: `PrefixCache._repr_html_` and `CacheStats._repr_html_` render here.

Pure string formatting of a stats snapshot (tiers, entries, bytes, hit rate, per-modality
hits, fallbacks); no Jupyter import, so the package needs no extra for it.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hf_prefix_cache.store.stats import CacheStats
    from hf_prefix_cache.store.tree_store import TreeStore

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


def stats_html(stats: CacheStats) -> str:
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


def store_html(store: TreeStore) -> str:
    """The store as HTML: its model and namespace, then its stats."""
    title = f"PrefixCache for {type(store.model).__name__}, namespace {store.namespace()[:12]}"
    return f"<div><b>{html.escape(title)}</b>{stats_html(store.stats())}</div>"
