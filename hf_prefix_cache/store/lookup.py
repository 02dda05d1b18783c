"""The low-level API for custom forward loops: `Lookup` (a restored, pinned prefix) and the id checks.

`PrefixCache.lookup` and `PrefixCache.insert` key token ids only; `check_manual_media` refuses
what only `generate` keys exactly, and `as_token_list` reads ids in every form users pass them.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from types import TracebackType

    from hf_prefix_cache.model.profile import ModelProfile
    from hf_prefix_cache.model.working_cache import WorkingCache
    from hf_prefix_cache.store.contract import Lease, Store


class Lookup:
    """A working cache restored from the store, pinned while the `with` block runs.

    Attributes:
        cache: a `transformers.Cache` holding the first `cached_len` tokens of the query.
        cached_len: how many leading tokens the model must not be fed again.
        matched_len: how many leading tokens matched stored ones (>= `cached_len`).
    """

    def __init__(self, store: Store, lease: Lease, cache: WorkingCache) -> None:
        self._store = store
        self._lease = lease
        self.cache = cache
        self.cached_len = lease.cached_len
        self.matched_len = lease.matched_len

    def release(self) -> None:
        """Unpin the entry; the cache stays usable."""
        self._store.release(self._lease)

    def __enter__(self) -> Lookup:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def check_manual_media(profile: ModelProfile, tokens: Sequence[int]) -> None:
    """`lookup`/`insert` key token ids only: refuse what only `generate` keys exactly.

    That is media, M-RoPE, prefix-LM, and encoder-decoder models (keyed by their encoder input).
    """
    problem = profile.media.manual_problem(tokens) if profile.media is not None else None
    if profile.encoder_family is not None:
        problem = "encoder-decoder"
    if problem is not None:
        raise ValueError(
            f"lookup()/insert() key token ids only and cannot serve this {problem} request exactly; "
            "use model.generate(**inputs, cache=store), which keys media by content"
        )


def as_token_list(ids: Any) -> list[int]:
    """Token ids from a tensor `[L]`/`[1, L]`, a list of ints, or a tokenizer's output (`input_ids` inside).

    Raises:
        TypeError: for float ids or anything else that is not token ids.
        ValueError: for a batch of several sequences.
    """
    if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):
        # apply_chat_template(tokenize=True, return_dict=True) and tokenizer(...) give a BatchEncoding.
        ids = ids["input_ids"] if isinstance(ids, Mapping) else ids.input_ids
    if isinstance(ids, torch.Tensor) and (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool):
        raise TypeError(f"token ids must be integers, got a {ids.dtype} tensor; pass input_ids, e.g. ids.long()")
    if not isinstance(ids, torch.Tensor):
        if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
            raise TypeError(f"expected token ids (a tensor or a list of ints), got {type(ids).__name__}")
        if ids and isinstance(ids[0], Sequence) and not isinstance(ids[0], str):
            if len(ids) != 1:
                raise ValueError(f"expected one sequence, got a batch of {len(ids)}; use rows one at a time")
            ids = ids[0]
        if all(type(t) is int for t in ids):  # the usual list, checked at C speed (abc checks cost ~1 us a token)
            return list(ids)
        bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, numbers.Integral | torch.Tensor)), None)
        if bad is not None:
            raise TypeError(f"token ids must be integers, got {bad!r} ({type(bad).__name__})")
    if isinstance(ids, torch.Tensor):
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise ValueError(f"expected one sequence, got a batch of {ids.shape[0]}; look up rows one at a time")
            ids = ids[0]
        if ids.dim() != 1:
            raise ValueError(f"expected token ids of shape [L] or [1, L], got {tuple(ids.shape)}")
        return [int(t) for t in ids.tolist()]
    return [int(t) for t in ids]
