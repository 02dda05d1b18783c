"""Byte budgets: sizes written as ints or strings ("4GB", "1.5 GiB"), and the default tier budgets."""

from __future__ import annotations

import math
import os
import re
import shutil
from decimal import Decimal
from pathlib import Path
from typing import Any

import torch

_GiB = 1 << 30
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


_SECONDS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400}


def parse_seconds(duration: float | str) -> float:
    """`90`, `"90s"`, `"30m"`, `"1.5h"`, `"2d"` -> seconds.

    Raises:
        ValueError: for a duration that is not positive or has an unknown unit.
        TypeError: for anything but a number or a string.

    >>> parse_seconds("1h")
    3600.0
    """
    if isinstance(duration, bool) or not isinstance(duration, int | float | str):
        raise TypeError(f"a duration is seconds or a string like '30m' or '1h', got {type(duration).__name__}")
    if isinstance(duration, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", duration)
        if m is None or m.group(2).lower() not in _SECONDS:
            raise ValueError(f"cannot read {duration!r} as a duration; write e.g. 600, '90s', '30m', '1h' or '2d'")
        seconds = float(m.group(1)) * _SECONDS[m.group(2).lower()]
    else:
        seconds = float(duration)
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"a duration must be a positive number of seconds, got {duration!r}")
    return seconds


def parse_nbytes(size: int | float | str) -> int:
    """`4096`, `2e9`, `"512MB"`, `"1.5 GiB"` -> bytes.

    Raises:
        ValueError: for a negative size or an unknown unit.
    """
    if isinstance(size, bool):
        raise TypeError("a byte size must be an int or a string like '4GB', not a bool")
    if isinstance(size, float):
        if not (math.isfinite(size) and size.is_integer()):
            raise ValueError(
                f"a byte size is a whole number of bytes, got {size!r}; for a fraction of a unit write e.g. '1.5GB'"
            )
        size = int(size)  # 2e9 and the like
    if isinstance(size, int):
        value = size
    elif not isinstance(size, str):
        raise TypeError(f"a byte size must be an int or a string like '4GB', got {type(size).__name__} {size!r}")
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", size)
        if m is None or m.group(2).lower() not in _UNITS:
            raise ValueError(f"cannot read {size!r} as a byte size; write e.g. 4096, '512MB' or '4GiB'")
        # Decimal, not float: "9007199254740993" or "0.1kB" must not round (a float holds 53 bits).
        value = int(Decimal(m.group(1)) * _UNITS[m.group(2).lower()])
    if value < 0:
        raise ValueError(f"a byte size cannot be negative, got {size!r}")
    return value


def _ram_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * _GiB


def available_ram_bytes() -> int:
    """Host memory a new allocation can take now: `MemAvailable` (Linux), else free pages, else all RAM."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return _ram_bytes()


def on_cuda(model: Any) -> bool:
    """Whether `model` runs on a CUDA device that is available."""
    device = getattr(model, "device", torch.device("cpu"))
    return bool(device.type == "cuda" and torch.cuda.is_available())


def default_max_bytes(model: Any) -> int:
    """Device budget: 30% of the GPU memory free once the model is loaded (CUDA); else a quarter of
    the host memory available now, at most 8 GiB."""
    if on_cuda(model):
        free, _ = torch.cuda.mem_get_info(model.device)
        return int(free * 0.3)
    return min(available_ram_bytes() // 4, 8 * _GiB)


def default_host_bytes(model: Any) -> int:
    """Host budget: a quarter of the host memory available now, up to 16 GiB, for a CUDA model; 0 for a
    CPU model (its device is the host)."""
    return min(available_ram_bytes() // 4, 16 * _GiB) if on_cuda(model) else 0


DEFAULT_DISK_BYTES = 20 * _GiB


def default_disk_bytes(disk_dir: str | os.PathLike[str]) -> int:
    """Disk budget: half the free space of the file system holding `disk_dir`, at most 20 GiB."""
    folder = Path(disk_dir).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return DEFAULT_DISK_BYTES
    return min(free // 2, DEFAULT_DISK_BYTES)
