"""``--api-server-count N``: N API server processes on one port, sharing one model's process and its one store.

As transformers' own ``Serve.run_api_servers``, whose classes it uses: this process binds the
socket, starts the forced model's process (`engine.StoreLoader`, with a query `engine.Channel`
that has a replies queue per API server) and spawns the API servers, each building the app
(`app.build_app`) joined to that process through its `EngineClient` connection (the shared
requests queue, its own results queue, its index). It runs until it is stopped or one of these
processes stops; then it stops the others.

Every API server sends its requests to the same process, so all of them reuse the same store, and
the jobs' metrics (`metrics.JobMetrics`) live there too; answers by status and the queue gauges
are each API server's own.
"""

from __future__ import annotations

import multiprocessing
import signal
import sys
import time
from multiprocessing.connection import wait
from typing import Any

from transformers.cli.serving.model_manager import EngineClient
from transformers.cli.serving.utils import GenerationState, run_until_parent_exits

from hf_prefix_cache.frontends.serve.app import ServeOptions, build_app
from hf_prefix_cache.frontends.serve.engine import StoreLoader


def serve_api(
    options: ServeOptions, loader: StoreLoader, sock: Any, connection: tuple[Any, ...], log_level: str
) -> None:
    """One API server (a spawned process): the app, joined to the model's process through `connection`."""
    import uvicorn

    app, models = build_app(options, loader=loader, engine_connection=connection, api_server=connection[2])
    serve_until_an_engine_dies(app, models, uvicorn.Config(app, log_level=log_level), sockets=[sock])


def serve_until_an_engine_dies(app: Any, models: Any, config: Any, sockets: list[Any] | None = None) -> int:
    """Run uvicorn with `config` until stopped, or until a model's process dies (as transformers serve does: whatever
    runs the server restarts it); returns the exit status (1: an engine died)."""
    import uvicorn

    server = uvicorn.Server(config)

    async def stop_if_an_engine_died() -> None:
        if models.is_dead:
            server.should_exit = True

    config.callback_notify, config.timeout_notify = stop_if_an_engine_died, 5
    server.run(sockets=sockets)
    if models.is_dead:
        print("hf-prefix-cache serve: a model's process died (see above): stopping", file=sys.stderr, flush=True)
        return 1
    return 0


def run_api_servers(options: ServeOptions, host: str, port: int, log_level: str) -> int:
    """Serve with `options.api_servers` API servers on `host`:`port` until stopped; returns the exit status."""
    import uvicorn

    if options.model is None:
        raise SystemExit("hf-prefix-cache serve: --api-server-count needs a model on the command line")
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, lambda *_: sys.exit(0))
    count = options.api_servers
    sock = uvicorn.Config(app=None, host=host, port=port).bind_socket()  # type: ignore[arg-type]
    loader = options.loader().for_engine(count)
    state = GenerationState(continuous_batching=False, compile=False)
    model_process, requests, results = EngineClient.start_process(options.model, loader, state, api_servers=count)
    spawn = multiprocessing.get_context("spawn")
    servers = [
        spawn.Process(
            target=run_until_parent_exits,
            args=(serve_api, options, loader, sock, (requests, results[index], index), log_level),
            name=f"api-server-{index}",
        )
        for index in range(count)
    ]
    processes = [model_process, *servers]
    for server in servers:
        server.start()
    try:
        ready = wait([process.sentinel for process in processes])
        stopped = [process for process in processes if process.sentinel in ready]
        for process in stopped:
            process.join()
        names = ", ".join(f"{process.name} (exit code {process.exitcode})" for process in stopped)
        print(f"hf-prefix-cache serve: {names} stopped: stopping the server", file=sys.stderr, flush=True)
        return 1
    finally:
        for process in processes:
            process.terminate()
        deadline = time.monotonic() + 10
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
        sock.close()
