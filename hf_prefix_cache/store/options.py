"""StoreOptions: a store's settings, checked once, with every budget resolved to bytes.

`PrefixCache` takes them as keyword arguments (documented there); `parse_options` checks each
one and names what to change when it is wrong, before anything is built.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_prefix_cache.model.layers import SLIDING_WINDOW_MODES
from hf_prefix_cache.storage.budgets import (
    default_disk_bytes,
    default_host_bytes,
    default_max_bytes,
    parse_nbytes,
    parse_seconds,
)
from hf_prefix_cache.storage.disk import usable_folder


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
class StoreOptions:
    """Checked settings; `budgets` is bytes per tier (device, host, disk), 0 for a tier that is off."""

    budgets: tuple[int, int, int]
    disk_root: Path | None
    policy: str
    ttl: float | None
    min_store_len: int
    max_entries: int | None
    snapshot_interval: int | None
    prompt_snapshot: bool
    salt: str | None
    save_on_exit: bool
    max_encoder_bytes: int | None
    sliding_window_mode: str
    remote: RemoteOptions | None


def parse_options(
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
    max_encoder_bytes: int | str | None = None,
    sliding_window_mode: str = "every_position",
    remote: str | None = None,
    max_remote_bytes: int | str | None = None,
    remote_write: str = "back",
    remote_chunk_len: int = 256,
    remote_ttl: float | None = None,
    remote_timeout: float = 2.0,
) -> StoreOptions:
    """Check `PrefixCache`'s keyword arguments and resolve the default budgets for `model`.

    Raises:
        ValueError: a setting out of range, or two that contradict each other (the message says which).
        TypeError: a setting of the wrong kind (a remote URL that is not a string).

    Example:
        >>> parse_options(None, max_bytes="1MB", max_host_bytes=0).budgets
        (1000000, 0, 0)
    """
    if sliding_window_mode not in SLIDING_WINDOW_MODES:
        raise ValueError(
            f"sliding_window_mode is one of {', '.join(SLIDING_WINDOW_MODES)}, got {sliding_window_mode!r}"
        )
    if snapshot_interval is not None and snapshot_interval < 1:
        raise ValueError(f"snapshot_interval must be a positive number of tokens or None, got {snapshot_interval}")
    if max_bytes is not None and max_device_bytes is not None:
        raise ValueError("give the device budget once: max_bytes or max_device_bytes, not both")
    seconds = parse_seconds(ttl) if ttl is not None else None
    if max_entries is not None and max_entries < 1:
        raise ValueError(f"max_entries is a positive count or None, got {max_entries}")
    if min_store_len < 1:
        raise ValueError(f"min_store_len is a positive number of tokens, got {min_store_len}")
    if max_disk_bytes is not None and disk_dir is None:
        raise ValueError("max_disk_bytes needs disk_dir: say where the disk tier lives")
    remote_options = _remote_options(
        remote, max_remote_bytes, remote_write, remote_chunk_len, remote_ttl, remote_timeout
    )
    disk_root = usable_folder(disk_dir) if disk_dir is not None else None
    device_budget = max_device_bytes if max_device_bytes is not None else max_bytes
    budgets = (
        parse_nbytes(device_budget) if device_budget is not None else default_max_bytes(model),
        parse_nbytes(max_host_bytes) if max_host_bytes is not None else default_host_bytes(model),
        0
        if disk_root is None
        else parse_nbytes(default_disk_bytes(disk_root) if max_disk_bytes is None else max_disk_bytes),
    )
    return StoreOptions(
        budgets=budgets,
        disk_root=disk_root,
        policy=policy,
        ttl=seconds,
        min_store_len=min_store_len,
        max_entries=max_entries,
        snapshot_interval=snapshot_interval,
        prompt_snapshot=prompt_snapshot,
        salt=salt,
        save_on_exit=save_on_exit,
        max_encoder_bytes=parse_nbytes(max_encoder_bytes) if max_encoder_bytes is not None else None,
        sliding_window_mode=sliding_window_mode,
        remote=remote_options,
    )


def _remote_options(
    url: str | None,
    max_remote_bytes: int | str | None,
    write: str,
    chunk_len: int,
    ttl: float | None,
    timeout: float,
) -> RemoteOptions | None:
    if url is None:
        given = [name for name, value in (("max_remote_bytes", max_remote_bytes), ("remote_ttl", ttl)) if value]
        if given or write != "back":
            raise ValueError(f"{', '.join(given) or 'remote_write'} needs remote: give the server's URL")
        return None
    if not isinstance(url, str):
        raise TypeError(f"remote is a URL string such as 'redis://localhost:6379/0', got {type(url).__name__}")
    if write not in ("back", "through"):
        raise ValueError(f"remote_write is 'back' or 'through', got {write!r}")
    if chunk_len < 1:
        raise ValueError(f"remote_chunk_len is a positive number of tokens, got {chunk_len}")
    if ttl is not None and ttl <= 0:
        raise ValueError(f"remote_ttl is a positive number of seconds or None, got {ttl}")
    if timeout <= 0:
        raise ValueError(f"remote_timeout is a positive number of seconds, got {timeout}")
    max_write = parse_nbytes(max_remote_bytes) if max_remote_bytes is not None else None
    return RemoteOptions(url, max_write, write, chunk_len, ttl, timeout)
