"""A real Redis Cluster of three masters on loopback ports, for the cluster tests of the remote tier.

Each master is a `redis-server` with ``cluster-enabled yes`` in a temporary folder, without
persistence; ``redis-cli --cluster create`` joins them (no replicas). `kill` stops one master
(its slots then fail); `stop` ends them all and deletes the folders. Skips without the binaries.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time

import pytest

from support.redis_server import _free_port

redis = pytest.importorskip("redis", reason="the cluster tests need the redis client")


def _cluster_port() -> int:
    """A free port whose cluster bus port (10000 above it) is valid and free too."""
    import socket

    while True:
        port = _free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


class RedisCluster:
    """Three cluster masters on 127.0.0.1; `url` (``redis+cluster://``) reaches them."""

    def __init__(self, num_masters: int = 3) -> None:
        server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if server is None or cli is None:
            pytest.skip("redis-server and redis-cli are not installed (apt-get install redis-server)")
        self.dir = tempfile.mkdtemp(prefix="hfpc-cluster-")
        self.ports = [_cluster_port() for _ in range(num_masters)]
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        try:
            for port in self.ports:
                self.procs[port] = subprocess.Popen(
                    [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
                    + ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf"]
                    + ["--cluster-node-timeout", "2000", "--dir", self.dir],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            for port in self.ports:
                self._wait_ping(port)
            nodes = [f"127.0.0.1:{p}" for p in self.ports]
            subprocess.run(
                [cli, "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
                check=True,
                capture_output=True,
                timeout=60,
            )
            self._wait_ok()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def client(self) -> object:
        """A cluster client (for the tests' own looks at the keys)."""
        return redis.cluster.RedisCluster(host="127.0.0.1", port=self.ports[0])

    def _wait_ping(self, port: int) -> None:
        deadline = time.monotonic() + 10
        while True:
            try:
                if redis.Redis(host="127.0.0.1", port=port, socket_timeout=1).ping():
                    return
            except redis.exceptions.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster node {port} did not start")
            time.sleep(0.1)

    def _wait_ok(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            infos = [redis.Redis(host="127.0.0.1", port=p).cluster("INFO") for p in self.ports]
            if all(info.get("cluster_state") == "ok" for info in infos):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not ready: {infos}")
            time.sleep(0.2)

    def master_of(self, key: str) -> int:
        """The port of the master holding `key`'s slot."""
        node = redis.cluster.RedisCluster(host="127.0.0.1", port=self.ports[0]).get_node_from_key(key)
        return int(node.port)

    def kill(self, port: int) -> None:
        """Stop one master at once (its slots fail until the test ends)."""
        proc = self.procs[port]
        proc.kill()
        proc.wait()

    def stop(self) -> None:
        """Stop every master and delete their folder."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
