"""Options: the keyword arguments of `PrefixCache`, declared once, checked once, budgets resolved to bytes.

`Options` is the one declaration of every setting (its fields are `PrefixCache`'s keyword
arguments, with their docs); it checks what it can alone and names what to change when a value
is wrong. `resolve` adds what needs the model or the file system: the default budgets and the
disk folder.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hf_prefix_cache.model.layers import SLIDING_WINDOW_MODES
from hf_prefix_cache.storage.budgets import (
    default_disk_bytes,
    default_host_bytes,
    default_max_bytes,
    parse_nbytes,
    parse_seconds,
)
from hf_prefix_cache.storage.disk import usable_folder


@dataclass(frozen=True, kw_only=True)
class Options:
    """The settings of a `PrefixCache`: each field is one of its keyword arguments.

    Example:
        >>> Options(max_bytes="1MB", ttl="30m").ttl
        '30m'
        >>> Options(min_store_len=0)
        Traceback (most recent call last):
        ...
        ValueError: min_store_len is a positive number of tokens, got 0
    """

    max_bytes: int | float | str | None = None
    """Device budget for keys, values and snapshots (int or e.g. ``"2GB"``). Default: 30% of the GPU
    memory free once the model is loaded (CUDA), else a quarter of the host memory available when
    the store is made, up to 8 GiB. `stats()` shows the budgets."""
    max_device_bytes: int | float | str | None = None
    """The same as `max_bytes` (give one of them)."""
    max_host_bytes: int | float | str | None = None
    """Host-memory budget (pinned memory on CUDA). Default: a quarter of the host memory available,
    up to 16 GiB, for a CUDA model; 0 (no host tier) for a CPU model, whose device is the host."""
    disk_dir: str | os.PathLike[str] | None = None
    """Folder for the disk tier (``~`` expanded, created if missing, checked writable); entries there
    survive a restart of the process."""
    max_disk_bytes: int | float | str | None = None
    """Disk budget (default: half the free space of `disk_dir`'s file system, at most 20 GiB)."""
    policy: str = "lru"
    """``"lru"`` (least recently used leaves first) or ``"cost"`` (keep what saves the most prefill
    work per byte; see `tree/policy.py`)."""
    ttl: float | str | None = None
    """Seconds (or a string like ``"30m"``, ``"1h"``) after which an unused entry is dropped (None: never)."""
    min_store_len: int = 1
    """Sequences shorter than this many tokens are not stored."""
    max_entries: int | None = None
    """Most entries (leaves) kept over all tiers (None: no limit)."""
    snapshot_interval: int | None = 256
    """For models with recurrent layers, also snapshot the state every this many prompt tokens
    (None: only at prompt ends, answers ends and divergences)."""
    prompt_snapshot: bool = True
    """For models with recurrent layers, snapshot the state at each prompt's last token but one, so
    that the same prompt again reuses all but its last token. It costs a forward more per request
    (the prefill is split there); a chat, which reuses the answer-end snapshots, does not need it
    (see `benchmarks/bench_prompt_snapshot.py`)."""
    salt: str | None = None
    """Isolates tenants: stores entries under a namespace no other salt shares."""
    save_on_exit: bool = True
    """With `disk_dir`, move what is in memory to disk when the process exits."""
    attach: bool | Literal["all"] = True
    """Wrap `model.generate`: calls that pass this store (or one of its sessions) as their cache use
    it. ``"all"``: also every call that passes no cache at all (a server's `model.generate(**inputs)`,
    a pipeline), while a call passing its own cache is left alone; per-request salts and reports
    come from `PrefixCache.request`. False: nothing is wrapped; use `lookup`/`insert` yourself.
    `detach` undoes either."""
    max_encoder_bytes: int | float | str | None = None
    """Encoder-decoder models served keyed by their encoder input (Whisper, BART, T5, ...): budget for
    stored encoder outputs, on the model's device and apart from `max_bytes` (default: an eighth of
    the device budget; 0 stores none)."""
    sliding_window_mode: str = "every_position"
    """How sliding-window layers are stored. ``"every_position"``: like full attention, so any length
    restores. ``"window"``: one window of keys/values per snapshot point (prompt ends, answer ends,
    divergences; no interval snapshots), about the model's own cache for long prompts; a prefix then
    restores only at those points, and such a model runs batches and media prompts cold."""
    remote: str | None = None
    """A Redis or Valkey URL (``redis://[user:password@]host:6379/0``, ``rediss://`` for TLS) for a tier
    shared by processes and machines, below the local ones (see `storage/remote.py`). The server
    evicts: run it with `maxmemory` and ``maxmemory-policy allkeys-lru``."""
    max_remote_bytes: int | float | str | None = None
    """The most bytes one entry may write to the remote tier (None: no limit)."""
    remote_write: str = "back"
    """``"back"``: entries are written when they leave the last local tier; ``"through"``: every new
    entry is also written when stored."""
    remote_chunk_len: int = 256
    """Tokens per remote chunk (only whole chunks are shared). For recurrent models make it a
    multiple of `snapshot_interval`, so chunk ends carry snapshots."""
    remote_ttl: float | None = None
    """Seconds a written chunk lives on the server (None: until it is evicted)."""
    remote_timeout: float = 2.0
    """Seconds any one call to the server may wait."""

    def __post_init__(self) -> None:
        if self.sliding_window_mode not in SLIDING_WINDOW_MODES:
            raise ValueError(
                f"sliding_window_mode is one of {', '.join(SLIDING_WINDOW_MODES)}, got {self.sliding_window_mode!r}"
            )
        if self.snapshot_interval is not None and self.snapshot_interval < 1:
            raise ValueError(
                f"snapshot_interval must be a positive number of tokens or None, got {self.snapshot_interval}"
            )
        if self.max_bytes is not None and self.max_device_bytes is not None:
            raise ValueError("give the device budget once: max_bytes or max_device_bytes, not both")
        if self.ttl is not None:
            parse_seconds(self.ttl)
        if self.max_entries is not None and self.max_entries < 1:
            raise ValueError(f"max_entries is a positive count or None, got {self.max_entries}")
        if self.min_store_len < 1:
            raise ValueError(f"min_store_len is a positive number of tokens, got {self.min_store_len}")
        if self.max_disk_bytes is not None and self.disk_dir is None:
            raise ValueError("max_disk_bytes needs disk_dir: say where the disk tier lives")
        _check_remote(self)
        if self.attach not in (True, False, "all"):
            raise ValueError(
                f'attach is True, False or "all" (serve calls that pass no cache too), got {self.attach!r}'
            )


@dataclass(frozen=True, slots=True)
class RemoteOptions:
    """Where and how the shared tier is reached (see `storage/remote.py`)."""

    url: str
    max_write_bytes: int | None
    write: str  # "back" or "through"
    chunk_len: int
    ttl: float | None
    timeout: float


@dataclass(frozen=True, slots=True)
class Resolved:
    """What `Options` become for one model: `budgets` in bytes per tier (device, host, disk; 0: off)."""

    options: Options
    budgets: tuple[int, int, int]
    disk_root: Path | None
    ttl: float | None
    max_encoder_bytes: int | None
    remote: RemoteOptions | None


def resolve(model: Any, options: Options) -> Resolved:
    """Resolve `options` for `model`: the default budgets, the disk folder (made and checked writable).

    Raises:
        ValueError: a budget that cannot be read, or a disk folder that cannot be written.
        TypeError: a budget of the wrong kind.

    Example:
        >>> resolve(None, Options(max_bytes="1MB", max_host_bytes=0)).budgets
        (1000000, 0, 0)
    """
    o = options
    remote = None
    if o.remote is not None:
        max_write = parse_nbytes(o.max_remote_bytes) if o.max_remote_bytes is not None else None
        remote = RemoteOptions(o.remote, max_write, o.remote_write, o.remote_chunk_len, o.remote_ttl, o.remote_timeout)
    disk_root = usable_folder(o.disk_dir) if o.disk_dir is not None else None
    device_budget = o.max_device_bytes if o.max_device_bytes is not None else o.max_bytes
    budgets = (
        parse_nbytes(device_budget) if device_budget is not None else default_max_bytes(model),
        parse_nbytes(o.max_host_bytes) if o.max_host_bytes is not None else default_host_bytes(model),
        0
        if disk_root is None
        else parse_nbytes(default_disk_bytes(disk_root) if o.max_disk_bytes is None else o.max_disk_bytes),
    )
    return Resolved(
        options=o,
        budgets=budgets,
        disk_root=disk_root,
        ttl=parse_seconds(o.ttl) if o.ttl is not None else None,
        max_encoder_bytes=parse_nbytes(o.max_encoder_bytes) if o.max_encoder_bytes is not None else None,
        remote=remote,
    )


def keyword_signature(*leading: str) -> inspect.Signature:
    """The signature `(*leading, *, <each field of Options>)`: what `help()` and editors show for a function
    that takes the options as keyword arguments (`PrefixCache`).

    Example:
        >>> list(keyword_signature("model").parameters)[:3]
        ['model', 'max_bytes', 'max_device_bytes']
    """
    params = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in leading]
    params += [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in inspect.signature(Options).parameters.values()]
    return inspect.Signature(params, return_annotation=None)


def _check_remote(o: Options) -> None:
    if o.remote is None:
        given = [
            name for name, value in (("max_remote_bytes", o.max_remote_bytes), ("remote_ttl", o.remote_ttl)) if value
        ]
        if given or o.remote_write != "back":
            raise ValueError(f"{', '.join(given) or 'remote_write'} needs remote: give the server's URL")
        return
    if not isinstance(o.remote, str):
        raise TypeError(f"remote is a URL string such as 'redis://localhost:6379/0', got {type(o.remote).__name__}")
    if o.remote_write not in ("back", "through"):
        raise ValueError(f"remote_write is 'back' or 'through', got {o.remote_write!r}")
    if o.remote_chunk_len < 1:
        raise ValueError(f"remote_chunk_len is a positive number of tokens, got {o.remote_chunk_len}")
    if o.remote_ttl is not None and o.remote_ttl <= 0:
        raise ValueError(f"remote_ttl is a positive number of seconds or None, got {o.remote_ttl}")
    if o.remote_timeout <= 0:
        raise ValueError(f"remote_timeout is a positive number of seconds, got {o.remote_timeout}")
