"""The store's contract with the code that runs the model: the verbs a generation hook uses and what they return.

A hook (`hooks/`) sees a store only through `Store` and a `Serving` value
handed to it once (the model's profile and the options it acts on); users pass the object made
around the store (`PrefixCache`) or a session of it as `generate`'s cache, and the hook finds the
store behind it (`hooks.pipeline.claim`). Per request the hook asks for the current
`namespace` (and derives the namespace of prompt-, media- or encoder-input-dependent states from
it itself, `keys.namespace.sub_namespace`), takes a `Lease` on the longest usable stored prefix
(restored into a fresh working cache it made from the profile), runs the model, gives the lease
back with `release`, stores the finished sequence with `insert_sequence`, and `record`s what
happened. Every verb is safe to call from several threads at once; the store serialises what
mutates it. Token ids read from a tensor go to the store as `token_ids.TokenIds` (the ints with
their bytes), which the tree compares at C speed.

Modelled on mini-sglang's documented `BasePrefixCache`: match (and pin), insert, release.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:
    from hf_prefix_cache.keys.prefix_key import PrefixKey
    from hf_prefix_cache.model.profile import ModelProfile
    from hf_prefix_cache.model.states import ItemState, Snapshot
    from hf_prefix_cache.model.working_cache import WorkingCache
    from hf_prefix_cache.storage.encoder_outputs import EncoderOutputs
    from hf_prefix_cache.store.sessions import Session


@dataclass(frozen=True, slots=True)
class Lease:
    """A stored prefix pinned for one request: its first `cached_len` symbols are in the caller's cache.

    `matched_len` (>= `cached_len`) symbols matched stored ones; `num_items` media item states
    were restored with the prefix. The pinned entry cannot be evicted or moved until the lease
    is given back, exactly once, with `Store.release`. `pin` is the store's handle; callers
    never read it.
    """

    namespace: str
    cached_len: int
    matched_len: int
    num_items: int
    pin: Any


@dataclass(frozen=True, slots=True)
class InsertOutcome:
    """What `Store.insert_sequence` did: `new_tokens` stored, or why nothing was (`skipped`, a reason)."""

    new_tokens: int
    skipped: str | None = None


class Served(NamedTuple):
    """A request served from the store, as `Store.record` counts it (and hands it on to the counters).

    `restore_len` of its `prompt_len` prompt tokens were restored, in each of its `num_rows` rows;
    `symbols` (the prompt's tree symbols, when it has media) split its hits by modality. A batch
    whose rows restored prefixes of their own gives each row's `(prompt_len, restore_len)` in `rows`,
    which the counters then sum instead.
    """

    prompt_len: int
    restore_len: int
    num_rows: int = 1
    symbols: Sequence[Hashable] | None = None
    rows: tuple[tuple[int, int], ...] = ()


class Fallback(NamedTuple):
    """A request run cold for `reason` (its `prompt_len` prompt tokens computed); logged too unless `log` is False."""

    reason: str
    prompt_len: int
    log: bool = True


class FallbackRan(NamedTuple):
    """A cold run counted earlier (`Fallback` with ``log=False``) ran: logged once per reason at WARNING, then DEBUG.

    `detail` (what a failed exactness check found, `errors.InconsistentStateError`) is logged with it.
    """

    reason: str
    detail: str = ""


class ReducedReuse(NamedTuple):
    """A served request that reused less than it could have, for `reason` (counted under `fallbacks`)."""

    reason: str


class NotStored(NamedTuple):
    """A served request whose states were not stored, for `reason` (counted under `fallbacks`): `detail`, what a
    failed exactness check found (`errors.InconsistentStateError`), is logged once per reason at WARNING, then DEBUG."""

    reason: str
    detail: str


#: What a hook tells a store happened to a request (`Store.record`).
Event = Served | Fallback | FallbackRan | ReducedReuse | NotStored


@dataclass(frozen=True, slots=True)
class Serving:
    """What a hook is handed once, beside its store: the model's profile (built once; the store holds the same
    one), the store's encoder outputs and the options a hook acts on.

    A hook makes its working caches from `profile` (`WorkingCache(profile)`). `encoder_outputs` is
    the store's byte-bounded store of encoder outputs, which encoder-keyed hooks read and fill
    (`hooks/encoder_keyed.py`). `snapshot_interval` and `prompt_snapshot` say where a
    recurrent model's prefill stops for a snapshot; `serves_uncached` whether `generate` calls
    that pass no cache are served too (``attach="all"``).
    """

    profile: ModelProfile
    encoder_outputs: EncoderOutputs
    snapshot_interval: int | None = None
    prompt_snapshot: bool = False
    serves_uncached: bool = False


@runtime_checkable
class Store(Protocol):
    """What a generation hook may ask of a store (implemented by `tree_store.TreeStore` alone)."""

    #: The model the store was made for (a hook refuses another model's store).
    model: Any

    def namespace(self) -> str:
        """The model's current namespace; re-reads the weights probe (mutates only the cached namespace).

        States that depend on more than the model (a whole prompt, its media, an encoder input) live
        in a namespace the hook derives from this one (`keys.namespace.sub_namespace`).
        """
        ...

    def has_entries(self, namespace: str) -> bool:
        """Whether anything is stored under `namespace`, whatever its symbols (reads only)."""
        ...

    def stored_len(self, namespace: str, symbols: Sequence[Hashable]) -> int:
        """How many leading `symbols` are stored under `namespace` (reads only)."""
        ...

    def next_symbols(self, namespace: str, symbols: Sequence[Hashable]) -> list[Hashable]:
        """The symbols stored right after all of `symbols` under `namespace`, one per continuation (reads only).

        Empty where `symbols` is not all stored. A hook reads them to tell why reuse stopped where it did
        (a media item stored keyed with other padding, `reasons.MEDIA_PADDING`).
        """
        ...

    def acquire(
        self,
        key: PrefixKey,
        into: WorkingCache,
        *,
        limit: int | None = None,
        batch_size: int = 1,
        overlap: bool = False,
    ) -> Lease:
        """Match `key`, pin the matched entry, restore the usable prefix into `into`, return the lease.

        Restores at most `limit` symbols (default: all but the last), never inside one of the
        key's media `spans`, repeated to `batch_size` rows. Mutates the tree's pins and use
        clocks, and may move entries between tiers to bring the prefix to the device. On any
        error nothing stays pinned, and after an out-of-memory error every unpinned entry has
        been moved off the device, so a second attempt into a fresh cache may fit. With
        `overlap`, keys still being copied back from host memory may be set in `into` layer by
        layer at first use (`WorkingCache.restore`), so only give it to the model's forward.
        """
        ...

    def release(self, lease: Lease) -> None:
        """Unpin the lease's entry; a second call does nothing (mutates only the pin count)."""
        ...

    def insert_sequence(
        self,
        key: PrefixKey,
        cache: WorkingCache,
        snapshots: Sequence[Snapshot] = (),
        *,
        row: int | None = None,
        session: Session | None = None,
        items: Sequence[ItemState] = (),
        computed_from: int = 0,
    ) -> InsertOutcome:
        """Store `cache`'s states of all of the key's symbols (plus earlier `snapshots` and media `items`).

        The cache (its `row`, for a batch) must hold exactly `len(key.symbols)` positions. Mutates
        the tree and may evict or move other entries to stay within the budgets; `session`, when
        given, pins the new entry.
        """
        ...

    def record(self, event: Event) -> None:
        """Count (and log, where the event says so) what happened to a request (mutates only counters and logs)."""
        ...
