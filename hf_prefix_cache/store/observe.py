"""What one request reused, for exporters: per-modality hit tokens and an estimate of the prefill spared.

The store counts these in its stats and hands a `RequestEvent` to every callback registered
with `PrefixCache.on_request` (outside its lock). Knows the media symbol encoding (through
`media.symbol_kind`) and a model's parameter count; nothing about the tree.

The prefill estimate is the usual dense-transformer count for the language model only:
``2 * P`` FLOPs per token for the decoder's ``P`` parameters (embeddings and the output head
excluded: generate computes the head for the last position only), plus ``4 * A`` per
(query, earlier key) pair, where ``A`` is the summed query width of the attention layers.
Vision and audio encoders skipped on a media hit are not counted, so it errs low.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hf_prefix_cache.multimodal.media import symbol_kind

TEXT = "text"


@dataclass(frozen=True, slots=True)
class RequestEvent:
    """One `generate` call through the store, as exporters see it.

    Attributes:
        prompt_len: prompt tokens per row.
        hit_len: tokens per row restored from the store (0 on a miss or a fallback).
        num_rows: rows of the batch.
        hit_tokens_by_modality: restored tokens over all rows by kind (``"text"``, ``"image"``,
            ``"video"``, ``"audio"``), only kinds with tokens.
        saved_prefill_flops: estimated prefill FLOPs the reuse spared (see the module docstring).
        fallback: why the request ran cold, or None when it was served.
    """

    prompt_len: int
    hit_len: int
    num_rows: int = 1
    hit_tokens_by_modality: dict[str, int] = field(default_factory=dict)
    saved_prefill_flops: int = 0
    fallback: str | None = None


RequestCallback = Callable[[RequestEvent], None]


def hit_tokens_by_modality(symbols: Sequence[Hashable] | None, hit_len: int, num_rows: int = 1) -> dict[str, int]:
    """Count the first `hit_len` prompt symbols by kind; plain token ids are text.

    `symbols` are a prompt's tree symbols (media placeholders as media symbols); None means
    all text. Media only occur in one-row calls, so text counts are multiplied by `num_rows`.
    """
    counts: dict[str, int] = {}
    if hit_len <= 0:
        return counts
    if symbols is None:
        return {TEXT: hit_len * num_rows}
    for symbol in symbols[:hit_len]:
        kind = symbol_kind(symbol)
        counts[kind] = counts.get(kind, 0) + (num_rows if kind == TEXT else 1)
    return counts


class PrefillCost:
    """Estimated FLOPs of prefilling positions `[start, end)` of a prompt on one model."""

    def __init__(self, num_params: int, attention_width: int) -> None:
        self.num_params = num_params
        self.attention_width = attention_width

    @classmethod
    def of(cls, model: Any, num_attention_layers: int) -> PrefillCost:
        """Read the decoder's parameter count and attention width from `model` and its config."""
        decoder = model
        get_decoder = getattr(model, "get_decoder", None)
        if callable(get_decoder):
            try:
                found = get_decoder()
            except Exception:  # some wrappers raise instead of returning None
                found = None
            if found is not None:
                decoder = found
        skip: set[int] = set()
        for getter in ("get_input_embeddings", "get_output_embeddings"):
            try:
                module = getattr(model, getter, lambda: None)()
            except Exception:  # e.g. NotImplementedError on composite models (Qwen2.5-Omni)
                module = None
            if module is not None:
                skip.update(id(p) for p in module.parameters())
        seen: set[int] = set()
        num_params = 0
        for p in decoder.parameters():
            if id(p) not in skip and id(p) not in seen:
                seen.add(id(p))
                num_params += p.numel()
        config = model.config
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        heads = _global_attr(text, "num_attention_heads") or 0
        head_dim = _global_attr(text, "head_dim") or (text.hidden_size // heads if heads else 0)
        return cls(num_params, num_attention_layers * heads * head_dim)

    def flops(self, start: int, end: int) -> int:
        """FLOPs to prefill positions `[start, end)` after `start` cached ones (0 when empty)."""
        if end <= start:
            return 0
        n = end - start
        # Position t attends to t + 1 keys: sum over [start, end) of (t + 1).
        pairs = (end * (end + 1) - start * (start + 1)) // 2
        return 2 * self.num_params * n + 4 * self.attention_width * pairs

    def flops_of(self, num_tokens: int, num_pairs: int) -> int:
        """FLOPs of prefilling `num_tokens` positions that attend to `num_pairs` (query, key) pairs in all.

        Sums of `flops(0, r)` over many prefixes: ``flops_of(sum(r), sum(r * (r + 1) // 2))``.

        >>> cost = PrefillCost(num_params=10, attention_width=2)
        >>> cost.flops_of(3 + 4, 6 + 10) == cost.flops(0, 3) + cost.flops(0, 4)
        True
        """
        return 2 * self.num_params * num_tokens + 4 * self.attention_width * num_pairs


def _global_attr(config: Any, name: str) -> int | None:
    """`config.name`, or None where it is missing or per-layer (Gemma 4 raises on the global read)."""
    try:
        value = getattr(config, name, None)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return None
    return value if isinstance(value, int) else None
