"""The request pipeline every family shares: check, key, restore, generate, store.

A hook checks the call (its own inputs, then `checks.py`) and keys it (namespace and tree
symbols); the functions here do the rest with the store's contract (`store/contract.py`):

- `claim`: whether a call is for this hook's store (the user's object that `stand_for` registered
  or a `Session` counts as its store, and so does no cache at all when the store was attached with
  ``attach="all"``), its cache argument taken out of a call that is;
- `bind_call`: a call bound to `generate`'s signature, with its model kwargs to edit;
- `run_cold`: the original `generate`, untouched, with the reason counted;
- `restore`: a lease on the longest usable stored prefix the rows share, restored into a fresh
  working cache, retried once when memory runs out (the store moves entries off the device), or
  why the call runs cold instead (`Cold`: out of memory twice, or a failed exactness guard);
- `guard_failed`, `not_stored`: a failed exactness guard (`errors.InconsistentStateError`) as a cold run, or as
  a served request not stored where the call cannot be run again;
- `sequence_keys`: the key of each finished row to store, prompt placeholders as media symbols;
  the hook hands each to `Store.insert_sequence` with the states it stores.

The lease is released by the hook in one `finally` around `generate`. A plain hit (one row of
text) calls `claim`, `restore` and `sequence_keys` once each and nothing else here.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from hf_prefix_cache import _compat, reasons
from hf_prefix_cache.errors import IncompatibleModelError, InconsistentStateError
from hf_prefix_cache.hooks.checks import read_to_host, rows_of, token_rows
from hf_prefix_cache.keys.prefix_key import PrefixKey
from hf_prefix_cache.model.profile import ModelProfile
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.storage.mover import is_out_of_memory
from hf_prefix_cache.store.contract import Fallback, FallbackRan, Lease, NotStored, Store
from hf_prefix_cache.store.sessions import Session

logger = logging.getLogger("hf_prefix_cache")


#: The user's objects that stand for a store where `generate` takes a cache (`stand_for`), read by `claim`.
_FRONTS: weakref.WeakKeyDictionary[Any, Store] = weakref.WeakKeyDictionary()


def stand_for(front: Any, store: Store) -> None:
    """Let `front` (the user's object made around `store`) stand for `store` where `generate` takes a cache."""
    _FRONTS[front] = store


def claim(store: Store, model: Any, kwargs: dict[str, Any], serves_uncached: bool) -> tuple[bool, Session | None]:
    """Whether a call's cache argument (in `kwargs`) is this store, directly or as one of its sessions, and the session.

    When it is, the cache argument is taken out of `kwargs` under every name (the hook passes a
    cache of its own, or none on a cold run). A call that passes no cache is this store's when the
    hook serves uncached calls (`serves_uncached`, ``attach="all"``).

    Raises:
        ValueError: a closed session was passed.
        IncompatibleModelError: a store made for another model object was passed.
    """
    given = _compat.cache_in(kwargs)
    session: Session | None = None
    if given is None:
        ours = serves_uncached
    else:
        if isinstance(given, Session):
            if given.closed:
                raise ValueError(f"session {given.name!r} is closed; open a new one with store.session(name)")
            session, given = given, given.store
        # The store behind the cache argument: the user's object made around one (`stand_for`), or a store itself.
        try:
            behind = _FRONTS.get(given)
        except TypeError:  # an unhashable cache argument
            behind = None
        if behind is None and isinstance(given, Store):
            behind = given
        ours = behind is store
        if not ours:
            if behind is not None and behind.model is not model:
                raise IncompatibleModelError(
                    f"this PrefixCache was built for another model object ({_describe(behind.model)}; this one is "
                    f"{_describe(model)}): a store serves only the model it was made with, even among models "
                    "of one class. Make one for this model: PrefixCache(model)"
                )
            return False, None
    if ours:
        _compat.pop_cache(kwargs)
    return ours, session


def bind_call(
    signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[inspect.BoundArguments, dict[str, Any]]:
    """A call bound to `generate`'s `signature`, and its model kwargs (its ``**kwargs``, a dict of the binding's own).

    Editing either changes only what `bound.args` / `bound.kwargs` pass on, never the caller's `kwargs`.
    """
    bound = signature.bind_partial(*args, **kwargs)
    return bound, bound.arguments.setdefault("kwargs", {})


class Cold(NamedTuple):
    """Why a restore gave up, so that the call runs cold: `reason`, and `detail` (what a failed guard found)."""

    reason: str
    detail: str = ""


def guard_failed(exc: InconsistentStateError, reason: str = reasons.INCONSISTENT_RESTORE) -> Cold:
    """A failed exactness guard: the call runs cold, never answered from those states.

    `reason`: `inconsistent_restore` before or during the cached run (a restore, a prefill, `generate`);
    `inconsistent_capture` when the finished cache disagreed with its sequence as its states were captured
    to store: the answer computed on that cache is not trusted either, so the call is run again, cold.
    """
    return Cold(reason, str(exc))


def not_stored(store: Store, exc: InconsistentStateError) -> None:
    """A failed exactness guard while a served request's states were captured to store, where the hook cannot run
    the call again (encoder-decoder hooks, inside `generate`): nothing more of it is stored; counted and logged once
    at WARNING."""
    store.record(NotStored(reasons.INCONSISTENT_CAPTURE, str(exc)))


def run_cold(
    store: Store,
    original: Callable[..., Any],
    reason: str | Cold,
    prompt_len: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """The original `generate`, untouched, with `reason` counted; logged (with a `Cold`'s detail) only once the call
    ran (a call that transformers rejects, such as one with a misspelt kwarg, raises its own error unannounced)."""
    reason, detail = (reason, "") if isinstance(reason, str) else reason
    store.record(Fallback(reason, prompt_len, log=False))
    output = original(*args, **kwargs)
    store.record(FallbackRan(reason, detail))
    return output


def restore(
    store: Store, profile: ModelProfile, key: PrefixKey, rows: Sequence[Sequence[int]], expand: int = 1
) -> tuple[Lease, WorkingCache] | Cold:
    """A lease on the stored prefix all `rows` share (never their last token, fed for its logits), restored.

    `key` is the first row's (its tree symbols, media spans included: one symbol per id); each row is restored
    `expand` times (`generate` makes that many rows of each for beams or several returned
    sequences) into a working cache made for `profile`. `Cold` when memory ran out twice (after a
    first out-of-memory error the store has moved its unpinned entries off the device, and it is
    tried once more into a fresh cache), or when an exactness guard failed (`guard_failed`). A
    failed attempt leaves nothing pinned and no half-restored cache.
    """
    shared = prompt_len = len(rows[0])
    if len(rows) > 1:
        shared = common_prefix_len(rows)
        if shared != len(key.symbols):
            key = key.prefix(shared)
    for attempt in range(2):
        try:
            cache = WorkingCache(profile)
            lease = store.acquire(
                key,
                cache,
                limit=min(shared, prompt_len - 1),
                batch_size=len(rows) * expand,
                overlap=True,  # only the model reads this cache, through `update` and the Cache methods
            )
            return lease, cache
        except InconsistentStateError as exc:
            return guard_failed(exc)
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            logger.warning("out of memory restoring a cached prefix (attempt %d): %s", attempt + 1, exc)
    return Cold(reasons.OUT_OF_MEMORY)


def restore_rows(
    store: Store, profile: ModelProfile, keys: Sequence[PrefixKey], pads: Sequence[int], expand: int = 1
) -> tuple[list[Lease], WorkingCache, int] | Cold:
    """Leases on each row's own longest stored prefix (one key a row), restored into one batch behind its left padding.

    The cache (made for `profile`) holds the same number of columns in every row, so the batch
    restores to the column `length` that every row reaches (its padding plus its stored prefix):
    row `i` gets `length - pads[i]` of its stored tokens (`WorkingCache.restore_rows`), each
    repeated `expand` times. Returns the leases (one per row, given back with `release_all`), the
    cache and `length`; `Cold` when memory ran out twice or a guard failed, as `restore`.
    """
    for attempt in range(2):
        leases: list[Lease] = []
        try:
            parts = []
            for key in keys:
                part = WorkingCache(profile)
                leases.append(store.acquire(key, part, limit=len(key.symbols) - 1))
                parts.append(part)
            # A row that restored nothing bounds the batch by its padding alone.
            length = min(pad + lease.cached_len for pad, lease in zip(pads, leases, strict=True))
            if not any(lease.cached_len and pad < length for pad, lease in zip(pads, leases, strict=True)):
                length = 0  # no row brings keys below that column: nothing to restore
            cache = WorkingCache(profile)
            if length:
                cache.restore_rows(list(zip(parts, pads, strict=True)), length, expand)
            return leases, cache, length
        except Exception as exc:
            release_all(store, leases)
            if isinstance(exc, InconsistentStateError):
                return guard_failed(exc)
            if not is_out_of_memory(exc):
                raise
            logger.warning("out of memory restoring cached prefixes (attempt %d): %s", attempt + 1, exc)
    return Cold(reasons.OUT_OF_MEMORY)


def release_all(store: Store, leases: Sequence[Lease]) -> None:
    """Give back every lease (each exactly once; `Store.release` ignores a second call)."""
    for lease in leases:
        store.release(lease)


def store_rows(
    store: Store,
    key: PrefixKey,
    sequences: torch.Tensor,
    cache: WorkingCache,
    pads: Sequence[int],
    computed_from: Sequence[int],
) -> None:
    """Store each row of `sequences` (a batch whose rows have their own left `pads`) with its states.

    Each row is stored under `key`'s namespace. Row `i` of the cache holds its tokens from column `pads[i]` on;
    they are copied out row by row
    (`WorkingCache.copy_row`) and stored as their own sequence. `computed_from[i]` is how many of
    the row's tokens were restored rather than computed by this request.
    """
    kv_len = cache.exact_length()  # all the cache holds, unless an indexer tied (`model/indexer_ties.py`)
    assert kv_len is not None, "rows are stored from layers of per-token keys"
    for row, ids in enumerate(token_rows(sequences[:, :kv_len])):
        pad = pads[row]
        if kv_len <= pad:
            continue
        part = cache.copy_row(row, pad, kv_len)
        store.insert_sequence(key.with_symbols(ids[pad:]), part, computed_from=computed_from[row])


def sequence_keys(key: PrefixKey, sequences: torch.Tensor, cache_len: int | None) -> list[PrefixKey]:
    """The key of each row of `sequences` to store: its first `cache_len` ids (None: all but the last), under
    `key`'s namespace and spans; no key when that is nothing.

    The last generated token is never fed back, so a cache covers all but it (`cache_len`, what it
    holds, may say less). Where the prompt holds media (`key.spans`), its placeholders are
    replaced by the key's media symbols in every row (rows of one prompt: samples). The caller
    stores each key with `Store.insert_sequence` (one row of a cache of several: `row=` its index).

    The rows are what `generate` returned, read in one piece (no operation on the device but the
    copy) and kept as bytes (`TokenIds`): reading the prompt part again costs a copy of 8 bytes per
    token, less than comparing it with the prompt on the device would.
    """
    length = sequences.shape[1] - 1 if cache_len is None else cache_len
    if length <= 0:
        return []
    host = read_to_host(sequences)  # whole rows: a slice of columns would be copied on the device first
    rows = rows_of(host[:, :length].tobytes(), len(host))
    if not key.spans:
        return [key.with_symbols(row) for row in rows]
    # Media symbols are a one-row prompt's: several rows are copies of it (samples of one prompt).
    prompt_symbols = key.symbols
    return [key.with_symbols([*prompt_symbols[:length], *row[len(prompt_symbols) :]]) for row in rows]


def common_prefix_len(rows: Sequence[Sequence[int]]) -> int:
    """How many leading ids every row shares.

    >>> common_prefix_len([[1, 2, 3], [1, 2, 4], [1, 5, 3]])
    1
    """
    first = rows[0]
    n = len(first)
    for row in rows[1:]:
        n = next((i for i, (a, b) in enumerate(zip(first[:n], row, strict=False)) if a != b), n)
    return n


def _describe(model: Any) -> str:
    return f"{type(model).__name__} at {id(model):#x}"
