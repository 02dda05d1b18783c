"""Notebook helpers: the store's radix tree as rows and as a drawing, and time to first token per turn as a plot.

Reads the store's tree under its lock and changes nothing. Drawing needs matplotlib
(the ``[jupyter]`` extra); `tree_nodes` does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hf_prefix_cache.api.display import format_nbytes
from hf_prefix_cache.api.prefix_cache import store_of
from hf_prefix_cache.multimodal.media import symbol_kind
from hf_prefix_cache.storage.tiers import TIER_NAMES

if TYPE_CHECKING:
    from hf_prefix_cache.api.prefix_cache import PrefixCache
    from hf_prefix_cache.frontends.chat import TurnReport

TIER_COLOURS = {"device": "#4c9f70", "host": "#e0a458", "disk": "#6c8ebf"}


@dataclass(frozen=True, slots=True)
class TreeNode:
    """One edge of the store's radix tree: positions `[start, end)` of its namespace's sequences."""

    id: int
    parent: int | None
    namespace: str
    start: int
    end: int
    tier: str
    nbytes: int
    media: dict[str, int]
    pinned: bool
    label: str


def _label(symbols: Sequence[Any], tokenizer: Any) -> str:
    parts: list[str] = []
    text: list[int] = []
    media: list[str] = []

    def flush() -> None:
        if text:
            parts.append(tokenizer.decode(text) if tokenizer is not None else f"{len(text)} tokens")
            text.clear()

    for s in symbols:
        kind = symbol_kind(s)
        if kind == "text":
            text.append(int(s))
        else:
            flush()
            if not media or media[-1] != kind:
                parts.append(f"[{kind}]")
            media.append(kind)
    flush()
    label = " ".join(p.strip() for p in parts if p.strip()).replace("\n", " ")
    return label if len(label) <= 40 else label[:37] + "..."


def tree_nodes(store: PrefixCache, tokenizer: Any = None) -> list[TreeNode]:
    """Every node of `store`'s tree, parents first, with its tier, bytes and a short label.

    Args:
        store: the store to read.
        tokenizer: decodes text for the labels (default: labels count tokens).
    """
    nodes = store_of(store).nodes()
    ids = {id(n): i for i, n in enumerate(nodes)}
    rows = []
    for i, n in enumerate(nodes):
        media: dict[str, int] = {}
        for s in n.key:
            kind = symbol_kind(s)
            if kind != "text":
                media[kind] = media.get(kind, 0) + 1
        parent = ids.get(id(n.parent)) if n.parent is not None else None
        rows.append(
            TreeNode(
                i,
                parent,
                str(n.namespace),
                n.start,
                n.end,
                TIER_NAMES[n.tier],
                n.nbytes,
                media,
                n.lock_ref > 0,
                _label(n.key, tokenizer),
            )
        )
    return rows


def draw_tree(store: PrefixCache, tokenizer: Any = None, ax: Any = None) -> Any:
    """Draw the store's radix tree: one box per node, coloured by tier, with its range and size.

    Returns:
        The matplotlib `Axes`.

    Example:
        >>> draw_tree(store, tokenizer)                               # doctest: +SKIP
    """
    plt = _pyplot()
    rows = tree_nodes(store, tokenizer)
    children: dict[int | None, list[TreeNode]] = {}
    for r in rows:
        children.setdefault(r.parent, []).append(r)
    for kids in children.values():
        kids.sort(key=lambda r: (r.start, r.label))
    x: dict[int, float] = {}
    depth: dict[int, int] = {}
    next_leaf = [0.0]

    def place(node: TreeNode, d: int) -> None:
        depth[node.id] = d
        kids = children.get(node.id, [])
        for kid in kids:
            place(kid, d + 1)
        if kids:
            x[node.id] = sum(x[k.id] for k in kids) / len(kids)
        else:
            x[node.id] = next_leaf[0]
            next_leaf[0] += 1.0

    for top in children.get(None, []):
        place(top, 0)
    if ax is None:
        width = max(6.0, 3.4 * max(next_leaf[0], 1.0))
        _, ax = plt.subplots(figsize=(width, 1.6 + 1.3 * (max(depth.values(), default=0) + 1)))
    for r in rows:
        if r.parent is not None:
            ax.plot([x[r.parent], x[r.id]], [-depth[r.parent], -depth[r.id]], color="#999", zorder=1)
    for r in rows:
        media = " ".join(f"{k}x{v}" for k, v in sorted(r.media.items()))
        text = f"[{r.start}, {r.end}) {r.tier} {format_nbytes(r.nbytes)}{' pinned' if r.pinned else ''}\n{r.label}"
        if media:
            text += f"\n{media}"
        ax.text(
            x[r.id],
            -depth[r.id],
            text,
            ha="center",
            va="center",
            fontsize=7,
            zorder=2,
            bbox={"boxstyle": "round", "facecolor": TIER_COLOURS.get(r.tier, "#ccc"), "alpha": 0.85},
        )
    ax.set_xlim(-0.8, max(next_leaf[0] - 0.2, 0.8))
    ax.set_ylim(-(max(depth.values(), default=0)) - 0.7, 0.7)
    ax.axis("off")
    ax.set_title(f"radix tree: {len(rows)} nodes (green device, orange host, blue disk)")
    return ax


def plot_ttft(reports: Sequence[TurnReport], ax: Any = None, title: str = "time to first token per turn") -> Any:
    """Bars of time to first token per turn, cold beside cached, with the reused share of each prompt.

    Returns:
        The matplotlib `Axes`.
    """
    plt = _pyplot()
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.2))
    turns = list(range(1, len(reports) + 1))
    cold = [r.ttft_cold_s or 0.0 for r in reports]  # a turn not timed cold has no cold bar
    ax.bar([t - 0.2 for t in turns], cold, width=0.4, label="cold", color="#c44e52")
    ax.bar([t + 0.2 for t in turns], [r.ttft_cached_s for r in reports], width=0.4, label="cached", color="#4c9f70")
    for t, r, c in zip(turns, reports, cold, strict=True):
        top = max(c, r.ttft_cached_s)
        label = f"{r.reused_len}/{r.prompt_len}" if r.reused_len else f"0/{r.prompt_len}\n{r.fallback or 'miss'}"
        ax.annotate(label, (t, top), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(turns)
    ax.set_xlabel("turn (labels: reused / prompt tokens; why, where none was reused)")
    ax.set_ylabel("seconds")
    ax.set_title(title)
    ax.legend()
    return ax


def _pyplot() -> Any:
    try:
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("plots need matplotlib: pip install matplotlib (the [jupyter] extra)") from exc
    return plt
