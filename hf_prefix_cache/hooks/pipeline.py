"""The request pipeline every family shares: check, key, restore, generate, store.

A hook checks and keys the call; the functions here do the rest with the store's contract
(`store/contract.py`): `claim` the call, `run_cold`, or `serve` it (the mode's restore step,
`generate`, the leases given back, the mode's store step, the request counted and logged).
The steps share `restore` (the one retry after running out of memory), `store_rows`,
`store_sequences` and `token_rows` (ids read to the host once).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

import numpy as np
import torch
from numpy.typing import NDArray

from hf_prefix_cache import _compat, reasons
from hf_prefix_cache.errors import IncompatibleModelError, InconsistentStateError
from hf_prefix_cache.hooks.refusals import CACHE_IMPLEMENTATION
from hf_prefix_cache.keys.prefix_key import PrefixKey
from hf_prefix_cache.model import batch_rows
from hf_prefix_cache.model.indexer_ties import IndexerTie
from hf_prefix_cache.model.profile import ModelProfile
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.storage.mover import is_out_of_memory
from hf_prefix_cache.store.contract import Fallback, FallbackRan, Lease, ReducedReuse, Served, Store
from hf_prefix_cache.store.sessions import Session
from hf_prefix_cache.token_ids import TokenIds

if TYPE_CHECKING:
    from hf_prefix_cache.hooks.call import Call, Row
    from hf_prefix_cache.model.layers import LayerState
    from hf_prefix_cache.model.states import ItemState, Snapshot

logger = logging.getLogger("hf_prefix_cache")


#: The user's objects that stand for a store where `generate` takes a cache (`stand_for`), read by `claim`.
_FRONTS: weakref.WeakKeyDictionary[Any, Store] = weakref.WeakKeyDictionary()


def stand_for(front: Any, store: Store) -> None:
    """Let `front` (the user's object made around `store`) stand for `store` where `generate` takes a cache."""
    _FRONTS[front] = store


def claim(store: Store, model: Any, kwargs: dict[str, Any], serves_uncached: bool) -> tuple[bool, Session | None]:
    """Whether a call's cache argument (in `kwargs`, taken out when it is) is this store or one of its sessions, and
    the session. A call passing no cache is this store's where the hook serves uncached calls (``attach="all"``).

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
                theirs, this = (f"{type(m).__name__} at {id(m):#x}" for m in (behind.model, model))
                raise IncompatibleModelError(
                    f"this PrefixCache was built for another model object ({theirs}; this one is {this}): a store "
                    "serves only the model it was made with, even among models of one class. Make one for this "
                    "model: PrefixCache(model)"
                )
            return False, None
    if ours:
        _compat.pop_cache(kwargs)
    return ours, session


class Cold(NamedTuple):
    """Why a restore gave up, so that the call runs cold: `reason`, and `detail` (what a failed guard found)."""

    reason: str
    detail: str = ""


def guard_failed(exc: InconsistentStateError, reason: str = reasons.INCONSISTENT_RESTORE) -> Cold:
    """A failed exactness guard: the call runs cold, never answered from those states (`reason`:
    `inconsistent_restore` before or during the cached run, `inconsistent_capture` as its states are stored)."""
    return Cold(reason, str(exc))


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


class Held(NamedTuple):
    """A restore step's answer: its leases (given back once `generate` ends), the working cache, the kwargs `generate`
    runs with, and what the mode's store step needs (`state`)."""

    leases: Sequence[Lease]
    cache: WorkingCache
    kwargs: dict[str, Any]
    state: Any = None


class Outcome(NamedTuple):
    """What a mode's store step found: the request as served, and why it reused less than it could (`reduced`)."""

    served: Served
    reduced: tuple[str, ...] = ()


class Request(Protocol):
    """What `serve` reads of a call (`Call`, `EncoderCall`): a cold run's arguments and length."""

    @property
    def args(self) -> tuple[Any, ...]: ...
    @property
    def kwargs(self) -> dict[str, Any]: ...
    @property
    def prompt_len(self) -> int: ...


class Holding(Protocol):
    """What `serve` reads of a restore step's answer (`Held`, `DecoderRequest`): leases and kwargs."""

    @property
    def leases(self) -> Sequence[Lease]: ...
    @property
    def kwargs(self) -> dict[str, Any]: ...


class RunCold(Exception):  # noqa: N818 (an instruction to the request path, not an error)
    """Raised inside `generate` by a restore completing there: the call runs cold for `cold`, counting `prompt_len`
    tokens, after `reset` (when given) puts back the given-up run's RNG state."""

    def __init__(self, cold: Cold, prompt_len: int, reset: Callable[[], None] | None = None) -> None:
        super().__init__(cold.reason)
        self.cold, self.prompt_len, self.reset = cold, prompt_len, reset


C = TypeVar("C", bound=Request)
H = TypeVar("H", bound=Holding)

#: A decoder-only mode's restore step: the call's prefixes pinned and restored (nothing held if it raises), or `Cold`.
RestoreStep = Callable[["Call"], "Held | Cold"]
#: A decoder-only mode's store step: the finished rows stored (raises `InconsistentStateError` when a guard fails).
StoreStep = Callable[["Call", Held, Any], Outcome]


def serve(
    store: Store,
    original: Callable[..., Any],
    call: C,
    restore_step: Callable[[C], H | Cold],
    store_step: Callable[[C, H, Any], Outcome],
) -> Any:
    """The request path of every mode (its `restore_step` and `store_step`): restore, generate, release, store, count.

    The call runs cold, counted, when the restore gives up (`Cold`, or `RunCold` inside `generate`), an
    indexer ties at its top-k, or a guard fails before the answer is made or as its rows are stored
    (`inconsistent_capture`: the answer computed on that cache is not trusted either).
    """
    held: H | Cold | None = None
    try:
        held = restore_step(call)
        if isinstance(held, Cold):
            return run_cold(store, original, held, call.prompt_len, call.args, call.kwargs)
        output = original(*call.args, **held.kwargs)
    except RunCold as given_up:
        if isinstance(held, Cold) or held is None:
            raise
        release_all(store, held.leases)
        if given_up.reset is not None:
            given_up.reset()
        return run_cold(store, original, given_up.cold, given_up.prompt_len, call.args, call.kwargs)
    except IndexerTie:
        return run_cold(store, original, reasons.INDEXER_TIE, call.prompt_len, call.args, call.kwargs)
    except InconsistentStateError as exc:
        return run_cold(store, original, guard_failed(exc), call.prompt_len, call.args, call.kwargs)
    finally:
        if held is not None and not isinstance(held, Cold):
            release_all(store, held.leases)
    try:
        outcome = store_step(call, held, output)
    except InconsistentStateError as exc:
        cold = guard_failed(exc, reasons.INCONSISTENT_CAPTURE)
        return run_cold(store, original, cold, call.prompt_len, call.args, call.kwargs)
    served = outcome.served
    store.record(served)
    if served.rows:
        reused = [restored for _, restored in served.rows]
        logger.info("prefix cache: reused %s of %s prompt tokens by row", reused, [n for n, _ in served.rows])
    else:
        rows = f" (x{served.num_rows} rows)" if served.num_rows > 1 else ""
        logger.info("prefix cache: reused %d of %d prompt tokens%s", served.restore_len, served.prompt_len, rows)
    for reason in outcome.reduced:
        store.record(ReducedReuse(reason))
    return output


def restore(
    store: Store, profile: ModelProfile, key: PrefixKey, batch_size: int = 1, limit: int | None = None
) -> tuple[Lease, WorkingCache] | Cold:
    """A lease on the stored prefix of one prompt's `key` (at most `limit` symbols; by default all but its last, fed
    for its logits), restored into `batch_size` rows of a fresh working cache made for `profile`.

    Tried once more after running out of memory (the store has moved its unpinned entries off the
    device then); `Cold` when memory ran out twice or a guard failed, with nothing left pinned.
    """
    for attempt in range(2):
        try:
            cache = WorkingCache(profile)
            lease = store.acquire(
                key,
                cache,
                limit=len(key.symbols) - 1 if limit is None else limit,
                batch_size=batch_size,
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


def release_all(store: Store, leases: Sequence[Lease]) -> None:
    """Give back every lease (each exactly once; `Store.release` ignores a second call)."""
    for lease in leases:
        store.release(lease)


def generate_kwargs(
    call: Call, profile: ModelProfile, cache: Any, kwargs: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The kwargs `generate` runs with on `cache` (a copy of `kwargs`, by default the call's): the cache under the
    model's name for it, and the call's `cache_implementation` dropped where the working cache serves it."""
    kwargs = dict(call.kwargs if kwargs is None else kwargs)
    kwargs[profile.cache_kwarg] = cache
    if call.drop_impl:
        kwargs[CACHE_IMPLEMENTATION] = None
    return kwargs


def sequences_of(output: Any) -> torch.Tensor:
    """The rows `generate` returned: its output, or the output's `sequences`."""
    sequences: torch.Tensor = output if isinstance(output, torch.Tensor) else output.sequences
    return sequences


def store_rows(
    store: Store,
    rows: Sequence[Row],
    sequences: torch.Tensor,
    cache: WorkingCache,
    length: int,
    computed_from: Sequence[int],
    ends: Mapping[int, tuple[int, dict[int, LayerState]]] | None = None,
) -> None:
    """Store the first `length` ids of each row of `sequences` (row `i` of `cache`, of the prompt row `rows[i]`) as
    its own entry without its left padding, `computed_from[i]` of its tokens restored; a row in `ends`
    (`recurrent_rows.EndStates`) up to its EOS instead, with the states it had then.

    Raises:
        InconsistentStateError: a row's EOS states lie past the `length` fed.
    """
    for i, ids in enumerate(token_rows(sequences, length)):
        pad, (end, states) = rows[i].pad, (ends or {}).get(i, (length, None))
        if end > length:
            raise InconsistentStateError(f"row {i}'s EOS states at {end} columns, past the {length} fed")
        if end <= pad:
            continue
        part = batch_rows.copy_row(cache, i, pad, end)
        for j, state in (states or {}).items():
            part.profile.adapters[j].load_state(part.layers[j], state)
        store.insert_sequence(rows[i].key.with_symbols(ids[pad:end]), part, computed_from=computed_from[i])


def store_sequences(
    store: Store,
    key: PrefixKey,
    sequences: torch.Tensor,
    cache: WorkingCache,
    session: Session | None,
    computed_from: int = 0,
    snapshots: Sequence[Snapshot] = (),
    items: Sequence[ItemState] = (),
) -> None:
    """Each row of `sequences` (one prompt's) stored from its row of `cache`, keyed by `sequence_keys` as far as
    the cache holds exactly; a lone row with `session`, `snapshots` and the media `items` it covers."""
    keys = sequence_keys(key, sequences, cache.exact_length())
    batched = len(keys) > 1  # each row stores its row of the cache; a session and media items are one row's
    for row, row_key in enumerate(keys):
        store.insert_sequence(
            row_key,
            cache,
            snapshots,
            row=row if batched else None,
            session=None if batched else session,
            items=[s for s in items if s.length <= len(row_key.symbols)] if items and not batched else (),
            computed_from=computed_from,
        )


def sequence_keys(key: PrefixKey, sequences: torch.Tensor, cache_len: int | None) -> list[PrefixKey]:
    """The key of each row of `sequences` to store: its first `cache_len` ids (None: all but the last, never fed
    back), under `key`'s namespace and spans, the prompt's placeholders replaced by the key's media symbols in every
    row (rows of one prompt: samples); no key when that is nothing.
    """
    length = sequences.shape[1] - 1 if cache_len is None else cache_len
    if length <= 0:
        return []
    rows = token_rows(sequences, length)
    namespace, prompt_symbols, spans, item_spans = key.namespace, key.symbols, key.spans, key.item_spans
    if not spans:
        return [PrefixKey(namespace, row, spans, item_spans) for row in rows]
    # Media symbols are a one-row prompt's: several rows are copies of it (samples of one prompt).
    return [
        PrefixKey(namespace, [*prompt_symbols[:length], *row[len(prompt_symbols) :]], spans, item_spans) for row in rows
    ]


def read_to_host(ids: torch.Tensor) -> NDArray[np.int64]:
    """Integer `ids` as int64 on the host, in one read (`.cpu()`; the array shares a CPU tensor's memory)."""
    host = ids.to(torch.int64).cpu()
    # The unpatched `numpy`: `keys/weights.py` records `.numpy()` aliases, which only parameters need.
    array: NDArray[np.int64] = torch._C.TensorBase.numpy(host)
    return array


def token_rows(ids: torch.Tensor | NDArray[np.int64], length: int | None = None) -> list[TokenIds]:
    """The rows of integer `ids` (read to the host once; whole, as a slice of columns would be copied on the device
    first) or of a host array, each its first `length` ids (None: all), as `TokenIds`: no Python int is made.

    >>> token_rows(torch.tensor([[5, 6], [7, 8]]))[1][1:]
    (8,)
    >>> token_rows(np.array([[5, 6], [7, 8]]), 1)[1][:]
    (7,)
    """
    host = read_to_host(ids) if isinstance(ids, torch.Tensor) else ids
    data, num_rows = (host if length is None else host[:, :length]).tobytes(), len(host)
    if num_rows == 1:
        return [TokenIds.from_bytes(data)]
    width = len(data) // num_rows
    return [TokenIds.from_bytes(data[i * width : (i + 1) * width]) for i in range(num_rows)]
