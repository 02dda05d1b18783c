"""Ties at a sparse-attention indexer's top-k boundary: where a continuation may select otherwise than a prefill.

An indexer (DeepSeek-V3.2, GLM-5, Mistral Large 4, Qwen4-Exp, ...) scores every key a query sees
and keeps the `k` best (`Tensor.topk`); attention then sees only those. What a continuation on a
restored prefix computes differs from a full prefill of the same prompt in three ways only:

- **which query rows:** the continuation computes the rows past the prefix; the prefix's rows
  were computed by an earlier call, of another length;
- **masking:** none: a row's scores cover the same keys (the causal mask of its own position),
  and masked keys score -inf (or the dtype's minimum), so they never displace a visible one;
- **float reductions:** a row's scores are a per-row product (`[heads, dim] @ [dim, keys]`), the
  same shape in both calls; but the call's length can change the reduction order of the layers
  before (measured on CPU in float32: bit for bit without ties; ~5e-7 of the row's largest score
  for a prefix row scored against fewer keys).

So a row keeps the same keys unless its `k`-th and `(k+1)`-th best scores lie within that float
noise of each other: an exact tie (keys whose weighted ReLU scores are all 0 tie at 0, common in
small models), which `topk` breaks by the call's shape, or a near-tie that noise can flip.
`TieWatch` checks every row of every indexer call on a `WorkingCache` for that margin
(`TIE_RTOL` of the row's largest visible score), on the device, and reads the forward's first tied
position once, after its last indexer (one device sync per forward, not one per layer or query).
A tied prompt row that a cold run computes in
another call (after a restored prefix, or in a chunk of a recurrent model's prefill) raises
`IndexerTie`, so the hook runs the request cold. A tie in the call a cold run makes too (the whole
prompt from position 0) or in a decode step (one row per call in a cold run too) keeps the output
and is recorded on the cache instead (`WorkingCache.tied_at`, the first such position): the states
before it are exact, those from it on are not stored. `WorkingCache.prompt_len` tells prompt
rows from decoded ones (0, unknown: every tie is only recorded).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

#: A row whose k-th and (k+1)-th scores differ by at most this fraction of its largest |score| is tied.
TIE_RTOL = 1e-5
_MASKED = -1e30  # scores at or below this are masked keys (-inf, or a float dtype's minimum added)
_TOPK = (torch.topk, torch.Tensor.topk)
_NONE = 2**62  # no tied row


class IndexerTie(Exception):
    """A row of a restored prefix's continuation tied at its indexer's top-k boundary (at `position`)."""

    def __init__(self, position: int) -> None:
        super().__init__(f"indexer scores tie at the top-k boundary of position {position}")
        self.position = position


def indexer_modules(model: nn.Module) -> list[nn.Module]:
    """The model's sparse-attention indexers: modules named `...Indexer` that know their layer."""
    return [m for m in model.modules() if type(m).__name__.endswith("Indexer") and hasattr(m, "layer_idx")]


class TieWatch:
    """Forward hooks on a model's indexers that check their top-k selections while they run on `cache_type`.

    Example:
        >>> from hf_prefix_cache.model.working_cache import WorkingCache
        >>> from torch import nn
        >>> watch = TieWatch.install(nn.Linear(2, 2), WorkingCache)
        >>> watch is None  # a model without indexers needs no watch
        True
    """

    def __init__(self, modules: list[nn.Module], cache_type: type) -> None:
        self._cache_type = cache_type
        self._first, self._last = modules[0], modules[-1]
        self._handles = []
        for module in modules:
            self._handles.append(module.register_forward_pre_hook(self._enter, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._exit, always_call=True))
        self._local = threading.local()  # each thread's open checks, and its forward's marks

    @classmethod
    def install(cls, model: nn.Module, cache_type: type) -> TieWatch | None:
        """Watch `model`'s indexers (None when it has none)."""
        modules = indexer_modules(model)
        return cls(modules, cache_type) if modules else None

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _state(self) -> Any:
        local = self._local
        if not hasattr(local, "modes"):
            local.modes, local.marks = [], []
        return local

    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        state = self._state()
        if module is self._first:
            state.marks = []  # a forward begins (one that raised before its last indexer left its marks)
        cache = next((v for v in (*args, *kwargs.values()) if isinstance(v, self._cache_type)), None)
        hidden = args[0] if args else kwargs.get("hidden_states")
        if cache is None or not isinstance(hidden, torch.Tensor):
            state.modes.append(None)
            return
        mode = _TopKCheck(cache, int(getattr(module, "layer_idx")), hidden.shape[-2], state.marks)  # noqa: B009
        mode.__enter__()  # type: ignore[no-untyped-call]
        state.modes.append(mode)

    def _exit(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        state = self._state()
        mode = state.modes.pop() if state.modes else None
        if mode is not None:
            mode.__exit__(None, None, None)
        if module is self._last and state.marks and mode is not None:
            # Read the forward's ties once, after its last indexer (one device sync per forward, not per layer).
            marks, state.marks = state.marks, []
            position = int(torch.stack(marks).min())
            if position < _NONE:
                mode.record(position)


class _TopKCheck(TorchFunctionMode):
    """While one indexer call runs: every `topk` it makes is checked for a tie at its boundary."""

    def __init__(self, cache: Any, layer_idx: int, num_rows: int, marks: list[torch.Tensor]) -> None:
        super().__init__()
        self._cache = cache
        self._layer_idx = layer_idx
        self._num_rows = num_rows
        self._marks = marks  # per `topk`: the first tied row's position (`_NONE`: none), still on the device

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in _TOPK:
            self._check(*args, **kwargs)
        return result

    def _check(self, scores: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> None:
        scores = scores.movedim(dim, -1)
        if k >= scores.shape[-1] or k <= 0:
            return  # every candidate is kept, whatever the scores
        scores = scores.float() if largest else -scores.float()
        best = scores.topk(k + 1, dim=-1).values
        kth, next_ = best[..., k - 1], best[..., k]
        scale = scores.masked_fill(scores <= _MASKED, 0).abs().amax(dim=-1)
        tied = (kth - next_ <= TIE_RTOL * scale) & (next_ > _MASKED)
        start = self._first_row_position()
        if scores.dim() >= 2 and scores.shape[-2] == self._num_rows:
            # Rows along dim -2 are the call's queries in order.
            rows = tied.reshape(-1, self._num_rows).any(dim=0)
            positions = torch.arange(start, start + self._num_rows, device=rows.device)
        else:
            # One query's scores (Qwen4-Exp scores each query alone): which one is not known here, so the call's first.
            rows = tied.reshape(1, -1).any(dim=1)
            positions = torch.full((1,), start, device=rows.device)
        self._marks.append(torch.where(rows, positions, _NONE).min())

    def _first_row_position(self) -> int:
        """The position of this call's first query: the indexer keys, updated already, hold the call's rows last."""
        layer = self._cache.layers[self._layer_idx]
        keys = getattr(layer, "indexer_keys", None)
        held = int(keys.shape[1]) if isinstance(keys, torch.Tensor) and keys.dim() >= 2 else self._num_rows
        return held - self._num_rows

    def record(self, position: int) -> None:
        """A row of this forward tied at `position`: raise `IndexerTie`, or note where the exact states end."""
        cache = self._cache
        start = self._first_row_position()
        prompt_len = getattr(cache, "prompt_len", 0)
        whole_prompt = start == 0 and self._num_rows >= prompt_len  # the one call a cold run makes too
        if position < prompt_len and not whole_prompt:
            # A prompt row computed in another call than a cold prefill's (after a restored prefix, or a
            # chunk of one): that prefill may keep other keys.
            raise IndexerTie(position)
        tied_at = getattr(cache, "tied_at", None)
        cache.tied_at = position if tied_at is None else min(tied_at, position)
