"""PrefixCache: the store users make and pass to `model.generate`.

A `TreeStore` (the store, which knows nothing of `generate`) plus what makes it usable from
`generate`: its options as keyword arguments, the hook of the model's family attached to
`model.generate` (`integration/`), `pin` (which may run the model) and a clear error when the
store is mistaken for a transformers `Cache`.
"""

from __future__ import annotations

import os
from typing import Any, Literal

import torch

from hf_prefix_cache.integration import Hook, family_of
from hf_prefix_cache.integration import attach as attach_hook
from hf_prefix_cache.store.display import store_html
from hf_prefix_cache.store.lookup import as_token_list
from hf_prefix_cache.store.options import parse_options
from hf_prefix_cache.store.tree_store import TreeStore

# Cache methods transformers calls; reaching one means the store was passed where a Cache was expected.
_CACHE_API = frozenset(
    {
        "get_seq_length",
        "update",
        "get_mask_sizes",
        "layers",
        "crop",
        "reorder_cache",
        "update_conv_state",
        "update_recurrent_state",
        "has_previous_state",
        "get_max_length",
        "is_initialized",
        "get_query_offset",
        "is_compileable",
        "is_sliding",
        "early_initialization",
        "batch_size",
    }
)


class _NotAWorkingCacheError(AttributeError):
    """A store was used where transformers expected a Cache."""


class PrefixCache(TreeStore):
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
        max_bytes: device budget for keys, values and snapshots (int or e.g. ``"2GB"``).
            Default: 30% of the GPU memory free once the model is loaded (CUDA), else a quarter of the
            host memory available when the store is made, up to 8 GiB. `stats()` shows the budgets.
        max_device_bytes: the same as `max_bytes` (give one of them).
        max_host_bytes: host-memory budget (pinned memory on CUDA). Default: a quarter of the host
            memory available, up to 16 GiB, for a CUDA model; 0 (no host tier) for a CPU model, whose
            device is the host.
        disk_dir: folder for the disk tier (``~`` expanded, created if missing, checked writable
            here); entries there survive a restart of the process.
        max_disk_bytes: disk budget (default: half the free space of `disk_dir`'s file system, at most 20 GiB).
        policy: ``"lru"`` (least recently used leaves first) or ``"cost"`` (keep what saves the
            most prefill work per byte; see `policy.py`).
        ttl: seconds (or a string like ``"30m"``, ``"1h"``) after which an unused entry is dropped (None: never).
        min_store_len: sequences shorter than this many tokens are not stored.
        max_entries: most entries (leaves) kept over all tiers (None: no limit).
        snapshot_interval: for models with recurrent layers, also snapshot the state every
            this many prompt tokens (None: only at prompt ends, answers ends and divergences).
        prompt_snapshot: for models with recurrent layers, snapshot the state at each prompt's last
            token but one (default), so that the same prompt again reuses all but its last token. It
            costs a forward more per request (the prefill is split there); a chat, which reuses the
            answer-end snapshots, does not need it (see `benchmarks/bench_prompt_snapshot.py`).
        salt: isolates tenants: stores entries under a namespace no other salt shares.
        save_on_exit: with `disk_dir`, move what is in memory to disk when the process exits.
        attach: wrap `model.generate` (default True): calls that pass this store (or one of its
            sessions) as their cache use it. ``"all"``: also every call that passes no cache at all
            (a server's `model.generate(**inputs)`, a pipeline), while a call passing its own cache is
            left alone; per-request salts and reports come from `store.scope.RequestScope`. False:
            nothing is wrapped; use `lookup`/`insert` yourself. `detach` undoes either.
        max_encoder_bytes: encoder-decoder models served keyed by their encoder input
            (Whisper, BART, T5, ...): budget for stored encoder outputs, on the model's device and apart from
            `max_bytes` (default: an eighth of the device budget; 0 stores none).
        sliding_window_mode: how sliding-window layers are stored. ``"every_position"`` (default):
            like full attention, so any length restores. ``"window"``: one window of keys/values
            per snapshot point (prompt ends, answer ends, divergences; no interval snapshots), about
            the model's own cache for long prompts; a prefix then restores only at those points,
            and such a model runs batches and media prompts cold.
        remote: a Redis or Valkey URL (``redis://[user:password@]host:6379/0``, ``rediss://`` for
            TLS) for a tier shared by processes and machines, below the local ones (see `storage/remote.py`).
            The server evicts: run it with `maxmemory` and ``maxmemory-policy allkeys-lru``.
        max_remote_bytes: the most bytes one entry may write to the remote tier (None: no limit).
        remote_write: ``"back"`` (default): entries are written when they leave the last local
            tier; ``"through"``: every new entry is also written when stored.
        remote_chunk_len: tokens per remote chunk (only whole chunks are shared). For recurrent
            models make it a multiple of `snapshot_interval`, so chunk ends carry snapshots.
        remote_ttl: seconds a written chunk lives on the server (None: until it is evicted).
        remote_timeout: seconds any one call to the server may wait.

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

    def __init__(
        self,
        model: Any,
        *,
        max_bytes: int | str | None = None,
        max_device_bytes: int | str | None = None,
        max_host_bytes: int | str | None = None,
        disk_dir: str | os.PathLike[str] | None = None,
        max_disk_bytes: int | str | None = None,
        policy: str = "lru",
        ttl: float | str | None = None,
        min_store_len: int = 1,
        max_entries: int | None = None,
        snapshot_interval: int | None = 256,
        prompt_snapshot: bool = True,
        salt: str | None = None,
        save_on_exit: bool = True,
        attach: bool | Literal["all"] = True,
        max_encoder_bytes: int | str | None = None,
        sliding_window_mode: str = "every_position",
        remote: str | None = None,
        max_remote_bytes: int | str | None = None,
        remote_write: str = "back",
        remote_chunk_len: int = 256,
        remote_ttl: float | None = None,
        remote_timeout: float = 2.0,
    ) -> None:
        options = parse_options(
            model,
            max_bytes=max_bytes,
            max_device_bytes=max_device_bytes,
            max_host_bytes=max_host_bytes,
            disk_dir=disk_dir,
            max_disk_bytes=max_disk_bytes,
            policy=policy,
            ttl=ttl,
            min_store_len=min_store_len,
            max_entries=max_entries,
            snapshot_interval=snapshot_interval,
            prompt_snapshot=prompt_snapshot,
            salt=salt,
            save_on_exit=save_on_exit,
            max_encoder_bytes=max_encoder_bytes,
            sliding_window_mode=sliding_window_mode,
            remote=remote,
            max_remote_bytes=max_remote_bytes,
            remote_write=remote_write,
            remote_chunk_len=remote_chunk_len,
            remote_ttl=remote_ttl,
            remote_timeout=remote_timeout,
        )
        if attach not in (True, False, "all"):
            raise ValueError(f'attach is True, False or "all" (serve calls that pass no cache too), got {attach!r}')
        family = family_of(model)
        super().__init__(model, options, family.name if family.encoder_keyed else None)
        self.serves_uncached = attach == "all"
        self._hook: Hook | None = attach_hook(self, model) if attach else None

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
        self.serves_uncached = False

    def _repr_html_(self) -> str:
        return store_html(self)

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
        tokens = as_token_list(token_ids)
        if not tokens:
            raise ValueError("pin() needs at least one token id")
        if self.profile.encoder_family is not None:
            raise ValueError("cannot pin on an encoder-decoder model: its prefixes are keyed by the encoder input too")
        namespace = self.namespace()
        stored = self.stored_len(namespace, tokens)
        if stored < len(tokens):
            if self._hook is None or self.profile.unsupported is not None:
                raise ValueError(
                    f"cannot pin: only {stored} of {len(tokens)} tokens are stored and this store cannot compute "
                    "the rest (attach=True and a supported model are needed); generate with the prefix first"
                )
            ids = torch.tensor([tokens], device=self.model.device)
            self.model.generate(ids, attention_mask=torch.ones_like(ids), cache=self, max_new_tokens=1, do_sample=False)
        if not self.pin_stored(namespace, tokens):
            raise ValueError(
                f"could not store the {len(tokens)}-token prefix: it does not fit the budgets "
                f"{self.budgets} (or ran cold: see stats().fallbacks); nothing pinned. Pin a shorter "
                "prefix or raise max_bytes"
            )
        return len(tokens)

    def __getattr__(self, name: str) -> Any:
        if name in _CACHE_API:
            raise _NotAWorkingCacheError(
                f"PrefixCache has no {name!r}: it is a store, not a transformers Cache. Pass it to the generate() "
                f"of the model object it was built for ({type(self.__dict__.get('model')).__name__} at "
                f"{id(self.__dict__.get('model')):#x}; another model, even of the same class, needs its own "
                "PrefixCache(model)), or use store.lookup(ids).cache in a custom forward loop."
            )
        raise AttributeError(name)
