"""A real `redis-server` on a free loopback port for the remote-tier tests, without persistence.

Started with ``--save '' --appendonly no`` so nothing is written to disk; stopped (or killed,
paused, restarted on the same port) by the tests. Skips the test when the binary is missing.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Any

import pytest

redis = pytest.importorskip("redis", reason="the remote-tier tests need the redis client: pip install -e '.[remote]'")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _self_signed(cert: str, key: str) -> None:
    """A self-signed certificate for 127.0.0.1 (the server's, and the CA the client trusts)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make a certificate for the TLS test")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
        check=True,
        capture_output=True,
    )


class RedisServer:
    """One `redis-server` process; `url` reaches it, `client()` talks to it directly."""

    def __init__(self, *args: str, password: str | None = None, tls: bool = False) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server is not installed (apt-get install redis-server, or bash scripts/install as root)")
        self.binary = binary
        self.args = list(args)
        self.password = password
        self.port = _free_port()
        self.dir = tempfile.mkdtemp(prefix="hfpc-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.cert = os.path.join(self.dir, "server.crt") if tls else None
        if self.cert is not None:
            _self_signed(self.cert, os.path.join(self.dir, "server.key"))
        self.start()

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.cert is not None:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.cert}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start (or restart, empty) on the same port, and wait until it answers."""
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        cmd += ["--dir", self.dir, *self.args]
        if self.cert is not None:  # TLS only: the plain port is closed
            key = os.path.join(self.dir, "server.key")
            cmd[1:3] = ["--port", "0", "--tls-port", str(self.port)]
            cmd += ["--tls-cert-file", self.cert, "--tls-key-file", key, "--tls-ca-cert-file", self.cert]
            cmd += ["--tls-auth-clients", "no"]
        if self.password:
            cmd += ["--requirepass", self.password]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client().ping()
                return
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start: {cmd}") from None
                time.sleep(0.02)

    def client(self) -> Any:
        return redis.Redis.from_url(self.url, socket_timeout=5)

    def kill(self) -> None:
        """SIGKILL, as a crashed server."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def pause(self) -> None:
        """SIGSTOP: the server accepts connections but answers nothing (a hung server)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)
