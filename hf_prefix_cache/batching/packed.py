"""Packed steps: rows joining the batch are prefilled in the decoding rows' own forward, not one forward each.

An admission through `generate` (`RunningBatch.admit`) is a forward of its own, and every row in flight waits
for it: on a CPU each forward reads every weight once (about 65 ms for SmolLM2 on two cores) before any
arithmetic, so a turn of 15 new tokens held the batch about 150 ms, three turns arriving together about
450 ms, the last of them waiting for all three. A packed step instead feeds ONE sequence of tokens: each
decoding row's next token, then each joining row's uncached prompt tokens (its stored prefix restored into its
row of the batch first), so the weights are read once for all of them.

```text
tokens   [ a5  b3 | c4 c5 c6 | d2 d3 ]      a, b decoding; c, d joining (c restored 4 positions, d 2)
rows     a: [ a0 .. a4 a5 ]  b: [ .  . b0 b1 b2 b3 ]  c: [ . c0 .. c3 c4 c5 c6 ]  d: [ .  .  . d0 d1 d2 d3 ]
```

Every row's cache ends at the step's column, as the batch lays its rows out (`layout.py`): the joining row's
restored prefix is placed with room for its new positions after it (`GrowingCache.add_row`'s `gap`), and the
step's update (`GrowingCache.packing` set) writes each row's new keys into its row. Only attention sees rows: the
attention function here runs transformers' own `sdpa_attention_forward` on the decoding rows (one query each,
the mask hiding each row's padding, as a plain step runs it) and on each joining row (its queries against its
own columns, causal past its prefix, as its prefill alone runs it), and lays the outputs back in token order.
Everything else in the model works token by token. Positions are each row's own.

Only for models whose every cached layer is plain full attention (`ModelProfile.defers_keys`, the batch's
cache then a `GrowingCache` laid out in place), run with transformers' `sdpa` attention: the model's
attention implementation is switched to this one for the packed forward alone (`packed_attention`) and back.

Example:
    >>> plan = Packing(decoding=2, pads=torch.tensor([0, 2]), joining=[Joiner(offset=2, new=3, first=1)])
    >>> plan.tokens, plan.last_indices()
    (5, [0, 1, 4])
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface

from hf_prefix_cache.errors import InconsistentStateError

#: The attention implementation's name while a packed forward runs (registered with transformers once, below).
NAME = "hf_prefix_cache_packed"


@dataclass(frozen=True)
class Joiner:
    """A row joining in a packed step: its `new` tokens at `offset` of the step's tokens, its columns from `first`."""

    offset: int
    new: int
    first: int


@dataclass(frozen=True)
class Packing:
    """One packed step: `decoding` rows feed one token each (`pads`: their padding columns), then `joining`'s."""

    decoding: int
    pads: torch.Tensor
    joining: list[Joiner] = field(default_factory=list)
    attention: str = "sdpa"  # the model's own implementation, run per group of rows: "sdpa" or "eager"
    shared: int = 0  # leading positions every decoding row holds alike (from its padding on): attended once

    @property
    def tokens(self) -> int:
        """Tokens the step feeds."""
        return self.decoding + sum(j.new for j in self.joining)

    def last_indices(self) -> list[int]:
        """Each row's last token among the step's tokens: the positions whose logits are kept."""
        return list(range(self.decoding)) + [j.offset + j.new - 1 for j in self.joining]


_PLAN: contextvars.ContextVar[Packing | None] = contextvars.ContextVar("hf_prefix_cache_packing", default=None)


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention of a packed step (`query` ``[1, heads, T, dim]``; `key`/`value` every row's columns ``[rows,
    kv_heads, columns, dim]``): transformers' sdpa per group of rows, the outputs ``[1, T, heads, dim]``."""
    plan = _PLAN.get()
    if plan is None or query.shape[0] != 1 or query.shape[2] != plan.tokens:
        raise InconsistentStateError("the packed attention ran outside a packed step (or on other tokens)")
    if any(kwargs.get(name) is not None for name in ("sliding_window", "softcap", "s_aux", "position_bias")):
        raise InconsistentStateError("the packed step runs plain full attention only")
    attend = _attention(module, plan.attention, query.dtype)
    columns = key.shape[-2]
    parts: list[torch.Tensor] = []
    decoding = plan.decoding
    if decoding:
        pads = plan.pads.to(key.device)
        q = query[0, :, :decoding].transpose(0, 1).unsqueeze(2)  # [rows, heads, 1, dim]
        if plan.shared and decoding > 1:
            out = cascade(q, key[:decoding], value[:decoding], pads, plan.shared, scaling)
        else:
            mask = torch.arange(columns, device=key.device)[None, :] >= pads[:, None]
            out = attend(q, key[:decoding], value[:decoding], mask[:, None, None, :], dropout, scaling)
        parts.append(out.reshape(1, decoding, *out.shape[2:]))
    for i, joiner in enumerate(plan.joining):
        row, span = decoding + i, slice(joiner.offset, joiner.offset + joiner.new)
        k, v = key[row : row + 1, :, joiner.first :], value[row : row + 1, :, joiner.first :]
        held = k.shape[-2] - joiner.new  # its restored positions
        seen = torch.arange(k.shape[-2], device=key.device)[None, :]
        causal = seen <= held + torch.arange(joiner.new, device=key.device)[:, None]
        if plan.attention == "sdpa" and query.shape[1] > k.shape[1]:
            parts.append(grouped(query[:, :, span], k, v, causal, scaling))
        else:
            parts.append(attend(query[:, :, span], k, v, causal[None, None], dropout, scaling))
    return torch.cat(parts, dim=1), None


def grouped(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """sdpa of one row's `query` ``[1, heads, n, dim]`` over its `key`/`value` with fewer heads ``[1, kv_heads,
    columns, dim]``, `allowed` ``[n, columns]``: the queries of the heads that read one kv head stacked as that kv
    head's queries, so no key or value is copied per head (transformers' sdpa copies each kv head to every head it
    serves: for a row joining after 1,500 stored positions, most of a packed step's time). ``[1, n, heads, dim]``,
    as transformers' sdpa returns it; the same attention, only its sums' order may differ (float rounding).
    """
    _, heads, n, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    q = query.reshape(1, kv_heads, group * n, dim)  # head h reads kv head h // group, as `repeat_kv` lays them
    out = torch.nn.functional.scaled_dot_product_attention(
        q, key, value, attn_mask=allowed.repeat(group, 1)[None, None], scale=scaling
    )
    return out.reshape(1, heads, n, dim).transpose(1, 2)


def cascade(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pads: torch.Tensor, shared: int, scaling: float | None
) -> torch.Tensor:
    """One query per row (`query` ``[rows, heads, 1, dim]``) over each row's keys from its padding on, where the
    first `shared` of them are alike in every row: those are read once, from row 0, for every row's queries, the
    rest per row; the two softmaxes are joined by their log-sum-exps. ``[rows, 1, heads, dim]``, as sdpa's.

    The result is attention over each row's own columns: only the order of the sums differs (float rounding).
    """
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    q = query.reshape(rows, kv_heads, group, dim)  # head h reads kv head h // group, as `repeat_kv` lays them
    first = int(pads[0])
    prefix = q.permute(1, 0, 2, 3).reshape(1, kv_heads, rows * group, dim)
    out_p, lse_p = _with_lse(
        prefix, key[:1, :, first : first + shared], value[:1, :, first : first + shared], None, scaling
    )
    out_p = out_p.reshape(kv_heads, rows, group, dim).permute(1, 0, 2, 3)
    lse_p = lse_p.reshape(kv_heads, rows, group).permute(1, 0, 2)
    start = int(pads.min()) + shared
    columns = torch.arange(start, key.shape[-2], device=key.device)
    hidden = columns[None, :] < (pads + shared)[:, None]  # a row's own shared part, or its padding
    bias = torch.zeros(hidden.shape, dtype=torch.float32, device=key.device).masked_fill_(hidden, float("-inf"))
    out_s, lse_s = _with_lse(q, key[:, :, start:], value[:, :, start:], bias[:, None, None, :], scaling)
    lse = torch.logaddexp(lse_p, lse_s)
    out = out_p.float() * torch.exp(lse_p - lse)[..., None] + out_s.float() * torch.exp(lse_s - lse)[..., None]
    return out.to(query.dtype).reshape(rows, heads, dim)[:, None]


def _with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scaling: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `q` ``[b, heads, n, dim]`` over `k`/`v` (as many heads) with an additive `bias`, and its float32
    log-sum-exp ``[b, heads, n]``: torch's CPU flash kernel on CPU (it returns both), plain products elsewhere."""
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    if q.device.type == "cpu":
        bias = bias.to(q.dtype) if bias is not None else None
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias, scale=scale
        )[:2]
        return out, lse.float()
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # elsewhere (CUDA): not the hot path here
    if bias is not None:
        scores = scores + bias
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v.float()).to(q.dtype), lse


def _attention(module: torch.nn.Module, name: str, dtype: torch.dtype) -> Any:
    """`attend(q, k, v, allowed, dropout, scaling)` through the model's own implementation `name`, with the mask
    that implementation takes (sdpa: the boolean `allowed`; eager: 0 where allowed, the dtype's least elsewhere)."""
    if name == "sdpa":

        def attend(q: Any, k: Any, v: Any, allowed: torch.Tensor, dropout: float, scaling: Any) -> torch.Tensor:
            out: torch.Tensor = sdpa_attention_forward(module, q, k, v, allowed, dropout=dropout, scaling=scaling)[0]
            return out

        return attend
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if name != "eager" or eager is None:
        raise InconsistentStateError(f"the packed step runs sdpa or eager attention, not {name}")

    def attend_eager(q: Any, k: Any, v: Any, allowed: torch.Tensor, dropout: float, scaling: Any) -> torch.Tensor:
        additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        additive.masked_fill_(~allowed, torch.finfo(dtype).min)
        out: torch.Tensor = eager(module, q, k, v, additive, dropout=dropout, scaling=scaling)[0]
        return out

    return attend_eager


AttentionInterface.register(NAME, packed_attention)


@contextlib.contextmanager
def packing(configs: list[Any], plan: Packing) -> Iterator[None]:
    """Within the block, the model whose `configs_of` are `configs` attends as the packed step does, laid out by
    `plan` (then as it did)."""
    before = [(c, c._attn_implementation) for c in configs]
    if any(name != plan.attention for _, name in before):
        raise InconsistentStateError(f"the packed step was planned for {plan.attention}, the model runs {before}")
    token = _PLAN.set(plan)
    try:
        for config, _ in before:
            config._attn_implementation = NAME
        yield
    finally:
        for config, name in before:
            config._attn_implementation = name
        _PLAN.reset(token)


def attention_of(model: Any) -> str | None:
    """`model`'s attention implementation where the packed step can run it per group of rows ("sdpa" or "eager"
    everywhere), else None."""
    names = {c._attn_implementation for c in configs_of(model)}
    name = names.pop() if len(names) == 1 else None
    return name if name in ("sdpa", "eager") else None


def configs_of(model: Any) -> list[Any]:
    """The configs `model`'s modules read their attention implementation from (a walk of every module: once per
    model, not per step)."""
    seen: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            seen.setdefault(id(config), config)
    return list(seen.values())
