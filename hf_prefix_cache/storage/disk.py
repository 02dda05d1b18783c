"""The disk tier: one safetensors file per stored segment, with its metadata as JSON in the header.

Layout: `<disk_dir>/<namespace>/<id>.safetensors`. The namespace (model class, config,
weights fingerprint, dtype, adapters, salt) names the folder, so a store only ever scans the
files of its own model. A file holds the keys/values of positions `[lo, hi)` of one sequence
the snapshots taken inside that range and the item states (Mllama: an image's cross-attention
keys/values) of media placeholders inside it; its JSON metadata holds the whole symbol sequence
`[0, hi)` (so a new process can rebuild the tree), the layout of the tensors and a 128-bit
checksum of the rest of the metadata and the tensors' bytes, checked on every load.

Writes are atomic (a temporary file in the same folder, flushed, then renamed). Nothing is
unpickled: tensors go through safetensors, metadata through JSON. A file that cannot be read,
is truncated, fails its checksum or belongs to another model is skipped with a warning.

`DiskTier` is a `Tier` (`tier.py`): `put` writes a file, `get` reads one back, `drop` lets go of
one and `flush` deletes the files let go of (outside the store's lock); what the disk tier needs
besides: `scan` and `stub_for` (a new process finds the files) and `add_snapshots` (a file gains
snapshots).

Knows segments and files; nothing about the tree.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.model.runs import Run
from hf_prefix_cache.model.states import ItemState, Snapshot
from hf_prefix_cache.storage.codec import CorruptFileError, Layout, decode, encode, stored_devices, verified
from hf_prefix_cache.storage.segments import DiskRef, Segment
from hf_prefix_cache.storage.tier import Place

logger = logging.getLogger("hf_prefix_cache")

FORMAT = "hf_prefix_cache.segment/3"  # /3: the checksum covers the metadata too
_META_KEY = "hf_prefix_cache"


@dataclass(frozen=True, slots=True)
class DiskEntry:
    """A segment file found by `DiskTier.scan`, read from its header only."""

    path: Path
    symbols: tuple[int, ...]
    lo: int
    hi: int
    nbytes_per_token: int
    snapshot_nbytes: dict[int, int]
    devices: list[str | None]
    item_nbytes: dict[int, int] = field(default_factory=dict)
    snapshot_reach: dict[int, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        states = sum(self.snapshot_nbytes.values()) + sum(self.item_nbytes.values())
        return (self.hi - self.lo) * self.nbytes_per_token + states


class DiskTier:
    """Reads and writes segment files under `root`.

    Example:
        >>> import tempfile
        >>> from hf_prefix_cache.model.runs import Run
        >>> from hf_prefix_cache.storage.segments import Segment
        >>> from hf_prefix_cache.storage.tier import Standalone
        >>> run = Run([torch.ones(1, 1, 4, 2)], [torch.zeros(1, 1, 4, 2)], 0, 4)
        >>> tier = DiskTier(tempfile.mkdtemp(), Layout(num_layers=1, kv_layers=(0,), state_layers=()))
        >>> stub = tier.put(Segment(run, 0, 4, run.nbytes_per_token), Standalone("ns", (5, 6, 7, 8)))
        >>> stub.run is None, stub.disk.hi
        (True, 4)
        >>> tier.get(stub, Standalone("ns", (5, 6, 7, 8))).run.keys[0].sum().item()
        8.0
    """

    name = "disk"

    def __init__(self, root: str | os.PathLike[str], layout: Layout) -> None:
        self.root = Path(root)
        self.layout = layout
        self._trash: list[Path] = []

    def folder(self, namespace: str) -> Path:
        return self.root / namespace

    # -------------------------------------------------------------- writing
    def put(self, seg: Segment, place: Place) -> Segment:
        """Write in-memory segment `seg` (positions `[seg.start, seg.end)` of `place`'s symbols); returns its disk stub.

        Raises:
            TypeError: when a symbol is not an int (only token ids and integer media symbols persist).
        """
        assert seg.disk is None, "put takes a segment in memory"
        namespace, symbols = place.namespace, place.symbols()
        if any(type(s) is not int for s in symbols):
            raise TypeError("only integer symbols can be written to disk")
        if len(symbols) != seg.end:
            raise InconsistentStateError(f"{len(symbols)} symbols for a segment ending at {seg.end}")
        keys: list[torch.Tensor | None] = []
        values: list[torch.Tensor | None] = []
        devices: list[str | None] = [None] * self.layout.num_layers
        if seg.run is not None:
            keys, values = seg.run.slice(seg.start, seg.end)
            devices = [str(d) if d is not None else None for d in seg.run.devices]
        meta: dict[str, Any] = {
            "format": FORMAT,
            "namespace": namespace,
            "symbols": list(symbols),
            "lo": seg.start,
            "hi": seg.end,
            "nbytes_per_token": seg.nbytes_per_token,
            "devices": devices,
        }
        tensors = encode(keys, values, seg.snapshots, seg.items, meta)
        folder = self.folder(namespace)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{uuid.uuid4().hex}.safetensors"
        tmp = folder / f".{path.stem}.tmp"
        try:
            save_file(tensors, str(tmp), metadata={_META_KEY: json.dumps(meta)})
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return _stub(
            path,
            seg.start,
            seg.end,
            seg.nbytes_per_token,
            devices,
            {n: s.nbytes for n, s in seg.snapshots.items()},
            {n: s.nbytes for n, s in seg.items.items()},
            {n: s.reach for n, s in seg.snapshots.items()},
        )

    def drop(self, seg: Segment) -> None:
        """`seg` no longer reads its file: the file is deleted once no segment reads it (see `delete`).

        A file read by the other parts of a split node stays; the placement rewrites it to what
        they cover (`put` of what `get` reads), so bytes on disk stay counted bytes.
        """
        ref = seg.disk
        assert ref is not None, "drop takes a disk stub"
        ref.num_refs -= 1
        if ref.num_refs == 0:
            self.delete(ref.path)

    def add_snapshots(self, parts: Sequence[Segment], snapshots: Sequence[Snapshot], place: Place) -> list[Segment]:
        """Rewrite the file that `parts` (the segments sharing it, in order) read, with `snapshots` added.

        `place` is where the last part sits. Returns the parts' new stubs, reading the new file;
        the old file is deleted only once the new one is in place (a failed write raises and
        keeps it).
        """
        first = parts[0]
        ref = first.disk
        assert ref is not None and all(p.disk is ref for p in parts), "add_snapshots takes the stubs sharing one file"
        assert len(parts) == ref.num_refs, f"{ref.path} counts {ref.num_refs} refs, {len(parts)} segments share it"
        whole = Segment(None, ref.lo, ref.hi, first.nbytes_per_token, disk=ref)
        for part in parts:
            whole.snapshots.update(part.snapshots)
            whole.items.update(part.items)
        loaded = self.get(whole, place)
        loaded.snapshots.update({s.length: s for s in snapshots})
        written = self.put(loaded, place)
        new_ref = written.disk
        assert new_ref is not None
        new_ref.num_refs = len(parts)
        self.delete(ref.path)
        return [
            Segment(
                None,
                part.start,
                part.end,
                part.nbytes_per_token,
                {n: s for n, s in written.snapshots.items() if part.start < n <= part.end},
                disk=new_ref,
                items={n: s for n, s in written.items.items() if part.start < n <= part.end},
            )
            for part in parts
        ]

    def delete_files(self, segs: Sequence[Segment]) -> None:
        """Delete the files `segs` read, each once (the store forgets them all)."""
        refs = {id(s.disk): s.disk for s in segs if s.disk is not None}
        for ref in refs.values():
            self.delete(ref.path)

    def delete(self, path: Path) -> None:
        """Schedule `path` for deletion by the next `flush` (the store calls it outside its lock).

        Unlinking a file whose pages were just read costs milliseconds (the kernel frees its
        page cache), which would otherwise stall every thread waiting on the store.
        """
        self._trash.append(path)

    def flush(self) -> None:
        """Delete the files scheduled by `delete` (and so by `drop`)."""
        while self._trash:
            path = self._trash.pop()
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:  # a read-only or vanished folder must not break generation
                logger.warning("could not delete %s: %s", path, exc)

    # -------------------------------------------------------------- reading
    def scan(self, namespace: str) -> tuple[list[DiskEntry], int]:
        """Every readable segment file of `namespace` by start position, and how many bad files were skipped.

        Each skipped file gets a warning naming it and what is wrong. Temporary files of writes
        that never finished (a killed process) are deleted.
        """
        folder = self.folder(namespace)
        if not folder.is_dir():
            return [], 0
        for tmp in folder.glob(".*.tmp"):  # left by a process killed mid-write (one process per folder)
            logger.debug("removing the unfinished write %s", tmp)
            tmp.unlink(missing_ok=True)
        entries = []
        skipped = 0
        for path in sorted(folder.glob("*.safetensors")):
            try:
                entries.append(self._read_header(path, namespace))
            except Exception as exc:  # any unreadable file is skipped, never fatal
                skipped += 1
                logger.warning("skipping prefix-cache file %s: %s", path, exc)
        entries.sort(key=lambda e: (e.lo, e.hi))
        return entries, skipped

    def stub_for(self, entry: DiskEntry) -> Segment:
        """The disk stub segment for a scanned entry."""
        return _stub(
            entry.path,
            entry.lo,
            entry.hi,
            entry.nbytes_per_token,
            entry.devices,
            entry.snapshot_nbytes,
            entry.item_nbytes,
            entry.snapshot_reach,
        )

    def get(self, stub: Segment, place: Place) -> Segment:
        """Read disk stub `stub` into a host-memory segment, checking the file's checksum.

        Raises:
            CorruptFileError: the file is missing, unreadable, altered or does not fit the model.
        """
        assert stub.disk is not None, "get takes a disk stub"
        path, run_lo, run_hi = stub.disk.path, stub.disk.lo, stub.disk.hi
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = json.loads((f.metadata() or {})[_META_KEY])
            tensors = load_file(str(path))
        except Exception as exc:
            raise CorruptFileError(f"cannot read {path}: {exc}") from exc
        if not verified(tensors, meta):
            raise CorruptFileError(f"{path} fails its checksum: its contents or header changed after it was written")
        if (meta.get("lo"), meta.get("hi")) != (run_lo, run_hi):
            raise CorruptFileError(f"{path} holds [{meta.get('lo')}, {meta.get('hi')}), expected [{run_lo}, {run_hi})")
        keys, values, snapshots, items = decode(tensors, meta, self.layout, stub)
        run = None
        if self.layout.kv_layers:
            run = Run(keys, values, run_lo, run_hi, devices=list(stub.disk.devices))
            run.take()
            if run.nbytes_per_token != stub.nbytes_per_token:
                raise CorruptFileError(
                    f"{path} holds {run.nbytes_per_token} bytes per token, expected {stub.nbytes_per_token}"
                )
        if sorted(snapshots) != sorted(stub.snapshots):
            raise CorruptFileError(f"{path} holds snapshots at {sorted(snapshots)}, expected {sorted(stub.snapshots)}")
        if sorted(items) != sorted(stub.items):
            raise CorruptFileError(f"{path} holds item states at {sorted(items)}, expected {sorted(stub.items)}")
        if run is not None and (stub.start, stub.end) != (run_lo, run_hi):
            # A split segment: keep only its own range, in tensors of its own.
            run.compact(stub.start, stub.end)
        return Segment(run, stub.start, stub.end, stub.nbytes_per_token, snapshots, items=items)

    def _read_header(self, path: Path, namespace: str) -> DiskEntry:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {})[_META_KEY])
            shapes = {name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype()) for name in f.keys()}  # noqa: SIM118
        expected_size = _data_end(path)
        if path.stat().st_size < expected_size:
            raise CorruptFileError(f"truncated: {path.stat().st_size} bytes, header needs {expected_size}")
        if meta.get("format") != FORMAT:
            raise CorruptFileError(f"unknown format {meta.get('format')!r}")
        if meta.get("namespace") != namespace:
            raise CorruptFileError("written for another model (namespace differs)")
        lo, hi = int(meta["lo"]), int(meta["hi"])
        symbols = tuple(int(s) for s in meta["symbols"])
        if not 0 <= lo < hi == len(symbols):
            raise CorruptFileError(f"range [{lo}, {hi}) does not fit {len(symbols)} symbols")
        layout = self.layout
        kv = sorted(int(name[2:]) for name in shapes if name.startswith("k."))
        if kv != list(layout.kv_layers):
            raise CorruptFileError(f"keys for layers {kv}, the model has them at {list(layout.kv_layers)}")
        for name, (shape, _) in shapes.items():
            if name[:2] in ("k.", "v.") and shape[-2] != hi - lo:
                raise CorruptFileError(f"{name} holds {shape[-2]} positions for a range of {hi - lo}")
        snapshot_nbytes = {int(n): int(s["nbytes"]) for n, s in meta["snapshots"].items()}
        snapshot_reach = {int(n): int(s.get("reach", 0)) for n, s in meta["snapshots"].items()}
        if any(not lo < n <= hi for n in snapshot_nbytes):
            raise CorruptFileError(f"snapshots at {sorted(snapshot_nbytes)} outside [{lo}, {hi})")
        item_nbytes = {int(n): int(s["nbytes"]) for n, s in meta.get("items", {}).items()}
        if any(not lo < n <= hi for n in item_nbytes):
            raise CorruptFileError(f"item states at {sorted(item_nbytes)} outside [{lo}, {hi})")
        devices = stored_devices(meta, layout.num_layers)
        return DiskEntry(
            path, symbols, lo, hi, int(meta["nbytes_per_token"]), snapshot_nbytes, devices, item_nbytes, snapshot_reach
        )


def usable_folder(disk_dir: str | os.PathLike[str]) -> Path:
    """`disk_dir` with `~` expanded, created if missing, once it is known to be a writable folder.

    Raises:
        ValueError: the path is empty, a file, or a folder this process cannot create or write in.
    """
    text = os.fspath(disk_dir)
    if not isinstance(text, str) or not text.strip():
        raise ValueError(
            f"disk_dir {disk_dir!r} is empty: give a folder for the disk tier (e.g. '~/.cache/prefixes'), "
            "or None for no disk tier"
        )
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"disk_dir {str(path)!r} is a file, not a folder: give a folder for the disk tier")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{uuid.uuid4().hex}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ValueError(
            f"disk_dir {str(path)!r} is not a folder this process can write in ({exc}); give another one"
        ) from exc
    return path


def _stub(
    path: Path,
    lo: int,
    hi: int,
    nbytes_per_token: int,
    devices: list[str | None],
    snapshot_nbytes: dict[int, int],
    item_nbytes: dict[int, int],
    snapshot_reach: dict[int, int] | None = None,
) -> Segment:
    ref = DiskRef(path, lo, hi, [torch.device(d) if d is not None else None for d in devices])
    reach = snapshot_reach or {}
    snapshots = {n: Snapshot(n, {}, nbytes, reach.get(n, 0)) for n, nbytes in snapshot_nbytes.items()}
    items = {n: ItemState(n, {}, nbytes) for n, nbytes in item_nbytes.items()}
    return Segment(None, lo, hi, nbytes_per_token, snapshots, disk=ref, items=items)


def _data_end(path: Path) -> int:
    """Bytes a safetensors file must have, from its header's last data offset."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
    ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    return 8 + header_len + max(ends, default=0)
