"""The `hf-prefix-cache` command: warm fills a disk tier a new store hits exactly, inspect reads it, bench and demo dispatch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import assert_same_as_cold

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.api.models import load_smollm2
from hf_prefix_cache.frontends.cli import main, parse_ratios

ROOT = Path(__file__).parents[2]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def smollm2() -> tuple[Any, Any]:
    return load_smollm2()


def _write_jsonl(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_warm_fills_a_disk_tier_that_a_new_store_hits_exactly(
    smollm2: tuple[Any, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """After `warm`, a new store on the same disk_dir reuses a warmed chat prompt (all but its last token) and equals a cold run."""
    model, tokenizer = smollm2
    jsonl = _write_jsonl(
        tmp_path / "prompts.jsonl",
        ["The capital of France is", {"prompt": "The capital of France is Paris, and of Italy"}, {"messages": CHAT}],
    )
    disk = tmp_path / "disk"
    assert main(["warm", str(jsonl), "--disk-dir", str(disk)]) == 0
    assert "warmed 3 requests" in capsys.readouterr().out

    store = PrefixCache(model, disk_dir=disk, save_on_exit=False)
    try:
        ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)[
            "input_ids"
        ]
        assert_same_as_cold(model, ids, store, new=4)
        assert store.stats().hit_tokens == ids.shape[1] - 1
        namespace = store._store.namespace()
    finally:
        store.detach()

    assert main(["inspect", str(disk), "--json"]) == 0
    (summary,) = json.loads(capsys.readouterr().out)
    assert summary["namespace"] == namespace and not summary["unreadable"]
    files = list((disk / namespace).glob("*.safetensors"))
    assert summary["files"] == len(files) > 0
    assert summary["nbytes"] == sum(f.stat().st_size for f in files)


def test_warm_rejects_a_bad_line_before_touching_the_store(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A JSONL line that is neither a string, a prompt nor a chat fails with its line number, and the disk tier is untouched."""
    disk = tmp_path / "disk"
    (disk / "ns").mkdir(parents=True)
    kept = disk / "ns" / "kept.safetensors"
    kept.write_bytes(b"not a real file, but must survive")
    jsonl = _write_jsonl(tmp_path / "bad.jsonl", ["fine", {"text": "no prompt key"}])
    assert main(["warm", str(jsonl), "--disk-dir", str(disk)]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2" in err and '{"prompt": "..."}' in err
    assert sorted(p.name for p in disk.rglob("*")) == ["kept.safetensors", "ns"]
    assert kept.read_bytes() == b"not a real file, but must survive"


def test_inspect_reports_unreadable_files_and_a_missing_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`inspect` lists a file it cannot read under its namespace, and a missing folder is a clear error."""
    (tmp_path / "ns1").mkdir()
    (tmp_path / "ns1" / "broken.safetensors").write_bytes(b"\x00" * 16)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ns1" in out and "unreadable: broken.safetensors" in out
    assert main(["inspect", str(tmp_path / "nowhere")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_module_entry_point_runs_inspect(tmp_path: Path) -> None:
    """`python -m hf_prefix_cache inspect DIR` runs the command line."""
    proc = subprocess.run(
        [sys.executable, "-m", "hf_prefix_cache", "inspect", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "no namespaces" in proc.stdout


def test_bench_runs_a_benchmark_and_writes_its_ratios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`bench media_hash --quick --json` prints the benchmark's ratio column and writes it as JSON."""
    out = tmp_path / "bench.json"
    assert main(["bench", "media_hash", "--quick", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())["benchmarks"][0]
    assert result["name"] == "media_hash" and result["returncode"] == 0
    assert "ours/raw" in result["ratios"]["llava fp32 image"]
    assert "ratio  llava fp32 image: ours/raw" in printed


def test_parse_ratios_reads_ratio_columns_only() -> None:
    """Columns named like `cold/hit` are ratios (a trailing x is dropped); units such as GB/s are not."""
    output = "case        raw GB/s  cold/hit  hit/ideal\nllava image    67.5     3.2x      1.01\n\nnext table\n"
    assert parse_ratios(output) == {"llava image": {"cold/hit": 3.2, "hit/ideal": 1.01}}


def test_demo_dispatches_to_the_demo(capsys: pytest.CaptureFixture[str]) -> None:
    """`demo --help` shows the demo's own options under its own name."""
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hf-prefix-cache demo") and "--repeats" in out
