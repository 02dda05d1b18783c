"""What a store does around its hot path: where stateful layers live, TTL expiry, disk indexing, remote fetches.

`Upkeep.maintain` runs under the store's lock before every match, where the store has a disk
tier or a ttl (`Upkeep.active`; otherwise there is nothing to maintain and it is not called): it
indexes the namespace's disk files on first use and drops expired entries at most every ttl/8 s.
`Upkeep.fetch_remote` loads, on a local miss of at least one whole chunk, what the remote tier
holds (the server is asked outside the lock). `StateDevices` remembers where each stateful
layer's states live.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from hf_prefix_cache import reasons
from hf_prefix_cache.model.states import Snapshot
from hf_prefix_cache.storage.remote import RemoteUnavailableError
from hf_prefix_cache.storage.segments import Segment
from hf_prefix_cache.storage.tier import Standalone
from hf_prefix_cache.store.counters import RequestCounters
from hf_prefix_cache.store.locking import StoreLock
from hf_prefix_cache.store.placement import Placement
from hf_prefix_cache.tree.radix import RadixTree


class StateDevices:
    """Where each stateful layer's states live (learned from the first snapshot), for bringing them back."""

    def __init__(self, default: torch.device | None) -> None:
        self._default = default
        self._devices: dict[int, torch.device] = {}

    def remember(self, snap: Snapshot) -> None:
        if len(self._devices) != len(snap.states):
            self._devices.update(snap.devices())

    def get(self, layer: int) -> torch.device | None:
        return self._devices.get(layer, self._default)


class Upkeep:
    """Disk indexing, TTL expiry and remote fetches for one store's tree.

    Attributes:
        active: whether `maintain` has anything to do (a disk tier or a ttl); callers skip it otherwise.
    """

    def __init__(
        self,
        tree: RadixTree[Segment],
        placement: Placement,
        lock: StoreLock,
        requests: RequestCounters,
        ttl: float | None,
    ) -> None:
        self._tree = tree
        self._placement = placement
        self._lock = lock
        self._requests = requests
        self.ttl = ttl
        self._next_expiry = 0.0
        self.active = placement.files is not None or ttl is not None

    def maintain(self, namespace: str) -> None:
        """Index the namespace's disk files on first use; drop expired entries (at most every ttl/8 s).

        Runs under the store's lock.
        """
        self._placement.index_disk(namespace)
        if self.ttl is None:
            return
        now = time.monotonic()
        if now < self._next_expiry:
            return
        self._next_expiry = now + min(self.ttl / 8, 1.0)
        deadline = now - self.ttl
        while True:
            stale = [n for n in self._tree.iter_nodes() if not n.children and n.lock_ref == 0 and n.used_at < deadline]
            if not stale:
                return
            for node in stale:
                self._placement.drop(node)
            self._requests.expired(len(stale))

    def fetch_remote(self, namespace: str, tokens: Sequence[Any], limit: int) -> None:
        """On a local miss of at least one whole chunk, load the chunks the remote tier holds into the tree.

        The server is asked outside the lock; a server that cannot be asked is counted as the
        `remote_unavailable` event and the request goes on with the local tiers.
        """
        remote = self._placement.remote
        assert remote is not None
        last = min(limit, len(tokens)) // remote.chunk_len
        if last == 0:
            return
        with self._lock():
            if self.active:
                self.maintain(namespace)
            have = self._tree.match(namespace, tokens).matched_len
        if have >= last * remote.chunk_len:
            return
        wanted = Segment(None, have // remote.chunk_len * remote.chunk_len, last * remote.chunk_len, 0)
        try:
            hit = remote.get(wanted, Standalone(namespace, tuple(tokens[: wanted.end])))
        except RemoteUnavailableError:
            self._requests.event(reasons.REMOTE_UNAVAILABLE)
            return
        if hit.end <= have:
            remote.drop(hit)
            return
        with self._lock(pressure=True):
            if not self._placement.adopt(namespace, tokens, hit):  # the tree grew past it meanwhile, or it fits no tier
                remote.drop(hit)
