"""PrefixCache: the store users make and pass to `model.generate`.

Made by composition: a private `TreeStore` (the store, which knows nothing of `generate`), the
hook of the model's family attached to `model.generate` (`hooks/`), and only the user's
verbs, each implemented once by the store (`pin`, which may run the model, is the exception).
Its keyword arguments are the fields of `store.options.Options`. Not a transformers `Cache`:
reaching a `Cache` method on it raises an error that says how to use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hf_prefix_cache._compat import check_transformers
from hf_prefix_cache.api.display import CacheStats, shown, store_html
from hf_prefix_cache.api.not_a_cache import not_a_cache_error
from hf_prefix_cache.hooks import Hook, family_of
from hf_prefix_cache.hooks import attach as attach_hook
from hf_prefix_cache.hooks.pipeline import stand_for
from hf_prefix_cache.model.profile import profile_model
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.store.contract import Serving
from hf_prefix_cache.store.lookup import Lookup, as_token_list
from hf_prefix_cache.store.observe import RequestCallback
from hf_prefix_cache.store.options import Options, keyword_signature, resolve
from hf_prefix_cache.store.pressure import PressureCallback
from hf_prefix_cache.store.scope import RequestScope
from hf_prefix_cache.store.sessions import Session
from hf_prefix_cache.store.tree_store import TreeStore


class PrefixCache:
    """A prefix store for one model: pass it as `cache` to `model.generate` (`past_key_values` works too).

    Each `generate` call through the store restores the longest usable cached prefix of the
    prompt, lets the model compute only the rest, and stores the finished sequence (prompt and
    answer) for later calls. Greedy outputs equal a cold run's; requests that cannot reuse
    safely run cold and are counted in `stats().fallbacks`.

    Stored entries live on three tiers, each with a byte budget: the model's device(s), host
    memory and, with `disk_dir`, disk. Past a budget the least valuable entries move to the
    next tier; they are dropped only when no tier can hold them. A hit on an entry off the
    device brings it back to the device of each layer.

    Args:
        model: a transformers generative model. Its `generate` is wrapped; calls that do not
            pass this store behave exactly as before.
        **options: the settings (budgets, tiers, policy, ttl, ``attach``, ...): each is a field of
            `store.options.Options`, documented there.

    Raises:
        ValueError: a setting out of range, or two that contradict each other (the message says which).
        TypeError: an unknown setting, or one of the wrong kind.

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).eval()
        >>> store = PrefixCache(model)
        >>> ids = torch.arange(4, 40)[None]
        >>> _ = model.generate(ids, cache=store, max_new_tokens=4, do_sample=False)
        >>> _ = model.generate(ids, cache=store, max_new_tokens=4, do_sample=False)
        >>> store.stats().hit_tokens
        35
    """

    def __init__(self, model: Any, **options: Any) -> None:
        settings = Options(**options)
        check_transformers()
        family = family_of(model)
        profile = profile_model(model, settings.sliding_window_mode, family.name if family.encoder_keyed else None)
        self._store = TreeStore(model, profile, resolve(model, settings))
        stand_for(self, self._store)
        serving = Serving(
            profile,
            self._store.encoder_outputs,
            settings.snapshot_interval,
            settings.prompt_snapshot,
            settings.attach == "all",
        )
        self._serving = serving
        self._hook: Hook | None = attach_hook(self._store, model, serving) if settings.attach else None

    @property
    def model(self) -> Any:
        """The model this store serves (it serves no other, even of the same class)."""
        return self._store.model

    @property
    def max_bytes(self) -> int:
        """The device budget in bytes; settable (``store.max_bytes = "1GB"``: the store shrinks to it at once).

        Example:
            >>> store.max_bytes = "2MB"
            >>> store.max_bytes, store.stats().max_bytes
            (2000000, 2000000)
        """
        return self._store.max_bytes

    @max_bytes.setter
    def max_bytes(self, value: int | str) -> None:
        self._store.max_bytes = value

    @property
    def budgets(self) -> dict[str, int]:
        """Budget in bytes per tier (0: the tier is off).

        Example:
            >>> PrefixCache(model, max_bytes="1MB", max_host_bytes=0, attach=False).budgets
            {'device': 1000000, 'host': 0, 'disk': 0}
        """
        return self._store.budgets

    def stats(self) -> CacheStats:
        """Counters and current size, as an immutable snapshot (Jupyter shows it as tables).

        Example:
            >>> before = store.stats().requests
            >>> _ = model.generate(ids, cache=store, max_new_tokens=1)
            >>> store.stats().requests - before, store.stats().entries > 0
            (1, True)
        """
        return shown(self._store.stats())

    def reset_stats(self) -> None:
        """Zero the request counters; stored entries stay.

        Example:
            >>> _ = model.generate(ids, cache=store, max_new_tokens=1)
            >>> store.reset_stats()
            >>> store.stats().requests, store.stats().entries > 0
            (0, True)
        """
        self._store.reset_stats()

    def check_integrity(self) -> None:
        """Raise `RuntimeError` when stored bytes, runs, files or snapshots disagree with the tree.

        Example:
            >>> _ = model.generate(ids, cache=store, max_new_tokens=1)
            >>> store.check_integrity()  # silent when all is well
        """
        self._store.check_integrity()

    def clear(self) -> None:
        """Drop every stored entry, on every tier (disk files included), stored encoder outputs, pins and sessions.

        Example:
            >>> _ = model.generate(ids, cache=store, max_new_tokens=1)
            >>> store.clear()
            >>> store.stats().entries
            0
        """
        self._store.clear()

    def save(self) -> int:
        """Move every unpinned entry in memory to the disk tier now; returns how many nodes moved.

        Entries on disk are found again by a new process with the same model and `disk_dir`.
        With `save_on_exit` (the default) this runs when the process exits.

        Raises:
            ValueError: when the store has no `disk_dir`.

        Example:
            >>> import tempfile
            >>> on_disk = PrefixCache(model, disk_dir=tempfile.mkdtemp())
            >>> _ = model.generate(ids, cache=on_disk, max_new_tokens=1)
            >>> on_disk.save(), on_disk.stats().disk_nbytes > 0
            (1, True)
            >>> on_disk.detach()
        """
        return self._store.save()

    def invalidate(self) -> None:
        """Forget everything stored, after changing the weights in a way the store cannot see.

        The store notices replaced parameters, in-place updates (`load_state_dict`, optimizer
        steps), switched adapters, and `.data` edits that touch the elements it samples. An
        in-place `.data` edit of only a few elements (one embedding row) can escape it: call
        this after one. Reads the weights again and drops every entry on every tier.

        Example:
            >>> _ = model.generate(ids, cache=store, max_new_tokens=1)
            >>> model.model.embed_tokens.weight.data[7] += 1  # one row: the sampled elements may miss it
            >>> store.invalidate()
            >>> store.stats().entries
            0
        """
        self._store.invalidate()

    def session(self, name: str) -> Session:
        """The open session called `name` (made on first use): pass it as `cache` (or `past_key_values`).

        The conversation's latest entry stays pinned until `session.close()`.

        Example:
            >>> with store.session("alice") as chat:
            ...     _ = model.generate(ids, cache=chat, max_new_tokens=2)
            ...     chat.held_len
            37
        """
        return self._store.session(name)

    def pin(self, token_ids: Any) -> int:
        """Keep the prefix `token_ids` (e.g. a system prompt) stored forever, never evicted or moved.

        `token_ids` is a tensor `[L]` or `[1, L]`, a list of ints, or what a tokenizer returns
        (`apply_chat_template(..., tokenize=True)`: its `input_ids` are used).

        Computes and stores it first if needed (one forward through the wrapped `generate`).
        Returns the pinned length. Undo with `unpin`.

        Raises:
            ValueError: when the prefix cannot be stored (model not served, over budget, or `attach=False`
                and not stored).
            TypeError: when the ids are not integers.

        Example:
            >>> store.pin(ids)  # e.g. tokenizer.apply_chat_template([system_turn], tokenize=True)
            36
            >>> store.unpin(ids)
            True
        """
        store = self._store
        tokens = as_token_list(token_ids)
        if not tokens:
            raise ValueError("pin() needs at least one token id")
        if store.profile.encoder_family is not None:
            raise ValueError("cannot pin on an encoder-decoder model: its prefixes are keyed by the encoder input too")
        namespace = store.namespace()
        stored = store.stored_len(namespace, tokens)
        if stored < len(tokens):
            if self._hook is None or store.profile.unsupported is not None:
                raise ValueError(
                    f"cannot pin: only {stored} of {len(tokens)} tokens are stored and this store cannot compute "
                    "the rest (attach=True and a supported model are needed); generate with the prefix first"
                )
            ids = torch.tensor([tokens], device=store.model.device)
            store.model.generate(
                ids, attention_mask=torch.ones_like(ids), cache=self, max_new_tokens=1, do_sample=False
            )
        if not store.pin_stored(namespace, tokens):
            raise ValueError(
                f"could not store the {len(tokens)}-token prefix: it does not fit the budgets "
                f"{store.budgets} (or ran cold: see stats().fallbacks); nothing pinned. Pin a shorter "
                "prefix or raise max_bytes"
            )
        return len(tokens)

    def unpin(self, token_ids: torch.Tensor | Sequence[int]) -> bool:
        """Undo `pin`; returns whether that prefix was pinned.

        Example:
            >>> store.unpin(ids)  # never pinned
            False
        """
        return self._store.unpin(token_ids)

    def lookup(self, input_ids: torch.Tensor | Sequence[int]) -> Lookup:
        """Restore the longest usable stored prefix of `input_ids` into a fresh working cache.

        For custom forward loops: feed the model `input_ids[:, lookup.cached_len:]` with
        `past_key_values=lookup.cache`, then call `insert` with the ids the cache now covers.

        Raises:
            ValueError: when the model cannot be served (reason in the message) or the ids are not one sequence.

        Example:
            >>> with store.lookup(ids) as hit:
            ...     out = model(ids[:, hit.cached_len:], past_key_values=hit.cache, use_cache=True)
            >>> store.insert(ids, hit.cache)  # new tokens stored
            36
        """
        return self._store.lookup(input_ids)

    def insert(self, token_ids: torch.Tensor | Sequence[int], cache: WorkingCache) -> int:
        """Store `cache` (from `lookup`), which must hold exactly the states of `token_ids`; returns new tokens stored.

        Raises:
            ValueError: when the cache's length disagrees with the ids, or it is not a working cache of this store.

        Example:
            >>> with store.lookup(ids[:, :8]) as hit:  # nothing stored yet: an empty cache
            ...     _ = model(ids[:, :8], past_key_values=hit.cache, use_cache=True)
            >>> store.insert(ids[:, :8], hit.cache), store.insert(ids[:, :8], hit.cache)
            (8, 0)
        """
        return self._store.insert(token_ids, cache)

    def on_pressure(self, callback: PressureCallback, thresholds: Sequence[float] = (0.8, 0.95)) -> None:
        """Call `callback(event)` when a tier's use rises past a fraction of its budget.

        Each threshold fires once per crossing (again only after use fell below it). The
        callback runs outside the store's lock, in the thread that stored the entry.

        Example:
            >>> events = []
            >>> small = PrefixCache(model, max_bytes=2 * 36 * 2 * 2 * 2 * 8 * 4)
            >>> small.on_pressure(events.append, thresholds=[0.5])
            >>> _ = model.generate(ids, cache=small, max_new_tokens=1)
            >>> [(e.tier, e.threshold) for e in events] == [("device", 0.5)]
            True
            >>> small.detach()
        """
        self._store.on_pressure(callback, thresholds)

    def request(self, salt: str | None = None) -> RequestScope:
        """A block of `generate` calls, and what they reused: ``with store.request() as r:`` ... ``r.cached_tokens``.

        The scope counts the calls through this store made inside the block, in this thread or
        asyncio task only, with the numbers `stats()` counts them by (`r.cached_tokens`,
        `r.prompt_tokens`, `r.calls`, `r.fallbacks`, ...: see `RequestScope`): concurrent
        requests each read their own. Blocks nest (a call counts in each enclosing block). A thread
        started inside the block does not see it: enter the scope in that thread (``with r:``; the
        calls of every entry add up), or start it with `contextvars.copy_context().run`
        (`asyncio.to_thread` does).

        Args:
            salt: the block's calls reuse only entries stored under this salt, and store theirs under
                it (a tenant's namespace in a server). None: the salt of an enclosing block, if any.

        Raises:
            ValueError: the salt is not a non-empty string.

        Example:
            >>> with store.request(salt="tenant-a") as first:
            ...     _ = model.generate(ids, cache=store, max_new_tokens=2)
            >>> with store.request(salt="tenant-a") as again:
            ...     _ = model.generate(ids, cache=store, max_new_tokens=2)
            >>> with store.request(salt="tenant-b") as other:
            ...     _ = model.generate(ids, cache=store, max_new_tokens=2)
            >>> first.cached_tokens, again.cached_tokens, other.cached_tokens, again.prompt_tokens
            (0, 35, 0, 36)
        """
        return self._store.request_scope(salt)

    def on_request(self, callback: RequestCallback) -> None:
        """Call `callback(RequestEvent)` after every `generate` request through the store.

        The event says what the request reused (per modality), the prefill it spared and why it
        ran cold, if it did; the callback runs outside the store's lock, and an exception in it
        is logged, never raised into `generate`. `hf_prefix_cache.frontends.prometheus` builds on
        the stats instead, for scraping.

        Example:
            >>> events = []
            >>> store.on_request(events.append)
            >>> for _ in range(2):
            ...     _ = model.generate(ids, cache=store, max_new_tokens=1)
            >>> events[-1].hit_tokens_by_modality
            {'text': 35}
        """
        self._store.on_request(callback)

    def detach(self) -> None:
        """Unwrap `model.generate`; the store keeps its entries and its low-level API.

        Example:
            >>> served = PrefixCache(model, attach="all")  # serves model.generate(ids) with no cache too
            >>> _ = model.generate(ids, max_new_tokens=2, do_sample=False)
            >>> served.stats().requests
            1
            >>> served.detach()
        """
        if self._hook is not None:
            self._hook.detach()
            self._hook = None

    def _repr_html_(self) -> str:
        store = self._store
        return store_html(store.model, store.namespace(), store.stats())

    def __getattr__(self, name: str) -> Any:
        store = self.__dict__.get("_store")
        raise not_a_cache_error(name, store.model if store is not None else None)


def store_of(cache: PrefixCache) -> TreeStore:
    """The store inside `cache`, for the package's own front ends and tests (its internals carry no promise).

    Example:
        >>> store_of(store).num_pinned_nodes()
        0
    """
    return cache._store


def serving_of(cache: PrefixCache) -> Serving:
    """What `cache`'s hook was made with (the profile, and where a recurrent prefill stops to snapshot), for a prefill
    run outside `generate` that must store what `generate`'s would (`batching/prefill.py`).

    Example:
        >>> serving_of(store).snapshot_interval, serving_of(store).prompt_snapshot
        (256, True)
    """
    return cache._serving


PrefixCache.__init__.__signature__ = keyword_signature("self", "model")  # type: ignore[attr-defined]
