"""The disk tier under altered files, unusable folders, a full disk and a process killed mid-write."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import Hits, assert_same_as_cold, build, distinct_prompt

from hf_prefix_cache import PrefixCache


def _alter_symbol(path: Path, position: int) -> tuple[int, int]:
    """Swap the token id at `position` in a segment file's JSON header for another of the same length."""
    raw = bytearray(path.read_bytes())
    header_len = int.from_bytes(raw[:8], "little")
    header = raw[8 : 8 + header_len].decode()
    match = re.search(r'symbols\\": \[([0-9, ]*)\]', header)
    assert match is not None, header[:200]
    ids = [int(x) for x in match.group(1).split(", ")]
    old = ids[position]
    new = old + 1 if len(str(old + 1)) == len(str(old)) else old - 1
    ids[position] = new
    text = ", ".join(map(str, ids))
    assert len(text) == len(match.group(1))
    header = header[: match.start(1)] + text + header[match.end(1) :]
    raw[8 : 8 + header_len] = header.encode()
    path.write_bytes(bytes(raw))
    return old, new


def test_a_file_whose_header_was_altered_is_never_served(tmp_path: Path) -> None:
    """One token id swapped in a saved file's header (same length) fails the checksum: the prompt it now names runs cold."""
    model = build("llama")
    ids = distinct_prompt(1, 24)
    store = PrefixCache(model, disk_dir=tmp_path, save_on_exit=False)
    assert_same_as_cold(model, ids, store)
    store.save()
    store.detach()
    (path,) = tmp_path.rglob("*.safetensors")
    old, new = _alter_symbol(path, 5)
    altered = ids.clone()
    assert int(altered[0, 5]) == old
    altered[0, 5] = new

    fresh = PrefixCache(model, disk_dir=tmp_path, save_on_exit=False)
    hits = Hits(fresh)
    try:
        assert_same_as_cold(model, altered, fresh)
        assert hits.last() == 0
        assert fresh.stats().skipped_files == 1
        fresh.check_integrity()
    finally:
        fresh.detach()
