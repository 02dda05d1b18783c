"""The `hf-prefix-cache` command (also `python -m hf_prefix_cache`): demo, chat, bench, inspect, warm, gradio, serve.

- ``demo``: the README's demo (`hf_prefix_cache.frontends.demo.main`).
- ``chat [MODEL]``: a streamed chat in the terminal (`hf_prefix_cache.frontends.terminal_chat`).
- ``bench [NAME ...] [--quick] [--json PATH]``: runs the scripts in a source checkout's
  ``benchmarks/``, prints their tables and the ratio columns, and can write both as JSON.
- ``inspect DIR``: what a disk tier holds, per namespace, read from the file headers only.
- ``warm FILE --disk-dir DIR``: fills a store and its disk tier from a JSONL of prompts or chats.
- ``gradio``: the multimodal chat (`hf_prefix_cache.frontends.gradio_app`).
- ``serve [MODEL]``: transformers' OpenAI-compatible server with a store per model
  (`hf_prefix_cache.frontends.serve`).

Long loops show a tqdm progress bar. The package core never imports this module. `--help` of every
command but `serve` imports neither torch nor transformers (the parsers of `demo`, `chat` and
`gradio` live in `args.py`). A command whose model cannot be loaded (the real SmolLM2 not
installed) prints one line naming what to install and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hf_prefix_cache.errors import ModelUnavailableError
from hf_prefix_cache.frontends.args import chat_parser, demo_parser, gradio_parser

logger = logging.getLogger("hf_prefix_cache")

BENCHMARKS = ("generate", "lookup", "media_hash", "vlm", "tiers", "seq2seq", "whisper", "chat", "serve")


def _progress(iterable: Any, **kwargs: Any) -> Any:
    try:
        from tqdm import tqdm
    except ImportError as exc:
        raise ImportError("progress bars need tqdm: pip install tqdm (the [cli] extra)") from exc
    return tqdm(iterable, file=sys.stderr, **kwargs)


# ----------------------------------------------------------------------- bench
def benchmarks_dir() -> Path:
    """The `benchmarks/` folder of the source checkout this package runs from, else of the working directory."""
    for root in (Path(__file__).resolve().parent.parent, Path.cwd()):
        if (root / "benchmarks" / "_common.py").is_file():
            return root / "benchmarks"
    raise FileNotFoundError(
        "no benchmarks/ folder: the benchmarks ship with the source checkout, not the wheel; "
        "run from a clone of the repository"
    )


def parse_ratios(output: str) -> dict[str, dict[str, float]]:
    """Ratio columns (headers like ``cold/hit``) of the tables in a benchmark's output, by row label."""
    ratios: dict[str, dict[str, float]] = {}
    header: list[str] | None = None
    for line in output.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) < 2:
            header = None
            continue
        columns = [i for i, c in enumerate(cells) if re.fullmatch(r"[A-Za-z_]+/[A-Za-z_]+", c) and not c.endswith("/s")]
        if columns and not re.match(r"^-?\d", cells[1]):
            header = cells
            continue
        if header is None or len(cells) < len(header):
            continue
        for i, name in enumerate(header):
            if i and re.fullmatch(r"[A-Za-z_]+/[A-Za-z_]+", name) and not name.endswith("/s"):
                value = re.sub(r"x$", "", cells[i])
                try:
                    ratios.setdefault(cells[0], {})[name] = float(value)
                except ValueError:
                    continue
    return ratios


def _bench(args: argparse.Namespace) -> int:
    folder = benchmarks_dir()
    names = args.names or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise SystemExit(f"unknown benchmark {unknown}; choose from {', '.join(BENCHMARKS)}")
    results = []
    failed = 0
    for name in names:
        command = [sys.executable, str(folder / f"bench_{name}.py"), *(["--quick"] if args.quick else [])]
        print(f"== bench_{name}.py {'--quick' if args.quick else ''}", flush=True)
        start = time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True, cwd=folder.parent, check=False)
        seconds = time.perf_counter() - start
        print(proc.stdout, end="", flush=True)
        if proc.returncode:
            failed += 1
            print(proc.stderr[-4000:], file=sys.stderr)
        ratios = parse_ratios(proc.stdout)
        for label, row in ratios.items():
            print("  ratio  " + label + ": " + ", ".join(f"{k} {v:g}" for k, v in row.items()))
        results.append(
            {
                "name": name,
                "command": command[1:],
                "returncode": proc.returncode,
                "seconds": round(seconds, 3),
                "ratios": ratios,
                "output": proc.stdout.splitlines(),
            }
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"quick": args.quick, "benchmarks": results}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if failed else 0


# --------------------------------------------------------------------- inspect
@dataclass(slots=True)
class NamespaceSummary:
    """What one namespace folder of a disk tier holds."""

    namespace: str
    files: int = 0  # readable entry files
    nbytes: int = 0  # their size on disk
    tokens: int = 0  # the positions they hold (each file its span `[lo, hi)` of a sequence)
    longest: int = 0  # the longest stored prefix: the furthest end of a span
    media_tokens: int = 0  # held positions that are media placeholders
    snapshots: int = 0  # state snapshots (of the layers that keep a state)
    item_states: int = 0  # media items' states (cross-attention layers)
    unreadable: list[str] = field(default_factory=list)  # files that could not be read, each with its error


def inspect_dir(root: Path) -> list[NamespaceSummary]:
    """Summaries of every namespace under a disk tier's folder, from the safetensors headers only.

    Raises:
        NotADirectoryError: `root` is not a folder.
    """
    from safetensors import safe_open

    from hf_prefix_cache.storage.disk import _META_KEY, FORMAT

    if not root.is_dir():
        raise NotADirectoryError(f"{root} is not a folder: pass the disk_dir a PrefixCache wrote to")
    files = sorted(root.glob("*/*.safetensors"))
    summaries: dict[str, NamespaceSummary] = {
        d.name: NamespaceSummary(d.name) for d in sorted(root.iterdir()) if d.is_dir()
    }
    for path in _progress(files, desc="reading headers", unit="file", disable=len(files) < 200 or None):
        summary = summaries[path.parent.name]
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = json.loads((f.metadata() or {})[_META_KEY])
            if meta.get("format") != FORMAT:
                raise ValueError(f"unknown format {meta.get('format')!r}")
            lo, hi = int(meta["lo"]), int(meta["hi"])
            symbols = meta["symbols"]
        except Exception as exc:  # report, never fail, on a bad file
            summary.unreadable.append(f"{path.name}: {type(exc).__name__}: {exc}")
            continue
        summary.files += 1
        summary.nbytes += path.stat().st_size
        summary.tokens += hi - lo
        summary.longest = max(summary.longest, hi)
        summary.media_tokens += sum(1 for s in symbols[lo:hi] if int(s) < 0)
        summary.snapshots += len(meta.get("snapshots", {}))
        summary.item_states += len(meta.get("items", {}))
    return list(summaries.values())


def _inspect(args: argparse.Namespace) -> int:
    from hf_prefix_cache.api.display import format_nbytes

    summaries = inspect_dir(Path(args.dir).expanduser())
    if args.json:
        print(json.dumps([_as_dict(s) for s in summaries], indent=2))
        return 0
    if not summaries:
        print(f"{args.dir}: no namespaces (an empty disk tier)")
        return 0
    print(f"{'namespace':18s} {'files':>6s} {'tokens':>8s} {'longest':>8s} {'media':>6s} {'snaps':>6s} {'bytes':>11s}")
    for s in summaries:
        print(
            f"{s.namespace[:18]:18s} {s.files:6d} {s.tokens:8d} {s.longest:8d} {s.media_tokens:6d} "
            f"{s.snapshots:6d} {format_nbytes(s.nbytes):>11s}"
        )
        for bad in s.unreadable:
            print(f"  unreadable: {bad}")
    total = sum(s.nbytes for s in summaries)
    print(f"{len(summaries)} namespace(s), {sum(s.files for s in summaries)} files, {format_nbytes(total)}")
    return 0


def _as_dict(obj: Any) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in obj.__slots__}


# ------------------------------------------------------------------------ warm
def read_requests(path: Path) -> list[dict[str, Any]]:
    """The requests of a JSONL file: each line a string, ``{"prompt": str}`` or ``{"messages": [...]}``.

    Raises:
        ValueError: naming the first bad line and the accepted forms (nothing has run yet).
    """
    forms = 'a JSON string, {"prompt": "..."} or {"messages": [{"role": ..., "content": ...}, ...]}'
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc.msg}); each line is {forms}") from exc
        if isinstance(item, str):
            item = {"prompt": item}
        if isinstance(item, dict) and isinstance(item.get("prompt"), str):
            requests.append({"prompt": item["prompt"]})
        elif isinstance(item, dict) and isinstance(item.get("messages"), list) and item["messages"]:
            requests.append({"messages": item["messages"]})
        else:
            raise ValueError(f"{path}:{number}: expected {forms}, got {line[:80]!r}")
    if not requests:
        raise ValueError(f"{path}: no requests; each line is {forms}")
    return requests


def _load(model: str) -> tuple[Any, Any]:
    from hf_prefix_cache.api.models import load_model, load_smollm2

    return load_smollm2() if model == "smollm2" else load_model(model)


def _warm(args: argparse.Namespace) -> int:
    import torch

    from hf_prefix_cache.api.display import format_nbytes
    from hf_prefix_cache.api.prefix_cache import PrefixCache, store_of

    requests = read_requests(Path(args.file))
    model, tokenizer = _load(args.model)
    store = PrefixCache(model, disk_dir=args.disk_dir, save_on_exit=False)
    try:
        for request in _progress(requests, desc="warming", unit="prompt"):
            if "prompt" in request:
                ids = tokenizer(request["prompt"], return_tensors="pt").input_ids
            else:
                ids = tokenizer.apply_chat_template(
                    request["messages"], add_generation_prompt=True, return_tensors="pt", return_dict=True
                )["input_ids"]
            with torch.inference_mode():
                model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    cache=store,
                    max_new_tokens=args.max_new_tokens,
                    do_sample=False,
                )
        moved = store.save()
        stats = store.stats()
        print(
            f"warmed {stats.requests} requests ({stats.prompt_tokens} prompt tokens, {stats.hit_tokens} reused); "
            f"{stats.entries} entries, {moved} nodes written, {format_nbytes(stats.disk_nbytes)} on disk "
            f"under {args.disk_dir}/{store_of(store).namespace()}"
        )
    finally:
        store.detach()
    return 0


# ------------------------------------------------------------------------ main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-prefix-cache", description="Exact prefix reuse for transformers generate."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="the quick-start demo (arguments go to it; try demo --help)", add_help=False)
    sub.add_parser("chat", help="a streamed chat in the terminal (try chat --help)", add_help=False)
    sub.add_parser("gradio", help="the multimodal Gradio chat (try gradio --help)", add_help=False)
    sub.add_parser(
        "serve", help="transformers' OpenAI-compatible server with prefix reuse (try serve --help)", add_help=False
    )
    bench = sub.add_parser("bench", help="run the benchmarks of a source checkout, print ratios")
    bench.add_argument("names", nargs="*", help=f"which ones (default all): {', '.join(BENCHMARKS)}")
    bench.add_argument("--quick", action="store_true", help="small sizes (smoke runs)")
    bench.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    inspect = sub.add_parser("inspect", help="what a disk tier holds, per namespace")
    inspect.add_argument("dir", help="the disk_dir of a PrefixCache")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    warm = sub.add_parser("warm", help="fill a store and its disk tier from a JSONL of prompts or chats")
    warm.add_argument("file", help='JSONL: each line a string, {"prompt": ...} or {"messages": [...]}')
    warm.add_argument("--disk-dir", required=True, help="the disk tier to fill (reused by later stores)")
    warm.add_argument("--model", default="smollm2", help="smollm2 (default, offline) or a hub id / folder")
    warm.add_argument("--max-new-tokens", type=int, default=1, help="answer tokens per request (default 1)")
    return parser


# The front ends whose parsers live in args.py: parsed before their module (and torch) is imported.
FRONT_ENDS = {
    "demo": (demo_parser, "hf_prefix_cache.frontends.demo"),
    "chat": (chat_parser, "hf_prefix_cache.frontends.terminal_chat"),
    "gradio": (gradio_parser, "hf_prefix_cache.frontends.gradio_app"),
}


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return _dispatch(argv)
    except ModelUnavailableError as exc:
        print(f"hf-prefix-cache {argv[0] if argv else ''}: {exc}", file=sys.stderr)
        return 2


def _dispatch(argv: list[str]) -> int:
    if argv and argv[0] == "serve":
        from hf_prefix_cache.frontends.serve_args import main as serve_main  # parses before importing the server

        return serve_main(argv[1:])
    if argv and argv[0] in FRONT_ENDS:
        make_parser, module_name = FRONT_ENDS[argv[0]]
        front_args = make_parser().parse_args(argv[1:])
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            print(f"hf-prefix-cache {argv[0]}: {exc}", file=sys.stderr)
            return 2
        status: int = module.run(front_args)
        return status
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        handler = {"bench": _bench, "inspect": _inspect, "warm": _warm}[args.command]
        return handler(args)
    except (ValueError, FileNotFoundError, NotADirectoryError) as exc:
        print(f"hf-prefix-cache {args.command}: {exc}", file=sys.stderr)
        return 2
