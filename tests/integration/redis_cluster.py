"""A real local Redis Cluster of three primaries, started and stopped by the tests.

Each node is a ``redis-server`` (or ``valkey-server``) of the test's own, on a free port
(its cluster bus port, port + 10000, free too), with ``--cluster-enabled yes``. The slots
are split in three ranges (``CLUSTER ADDSLOTSRANGE``), the nodes meet (``CLUSTER MEET``),
and the cluster is ready once every node says ``cluster_state:ok`` and knows the others.
``cluster-require-full-coverage no``, as docs/locks.md advises: a stopped node stalls its
own slots only. The shared Redis of the machine is never touched.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Collection
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

#: The three primaries' slot ranges.
SLOT_RANGES = ((0, 5460), (5461, 10922), (10923, 16383))


def server_binary() -> str | None:
    """A Redis or Valkey server that can run in cluster mode, or None."""
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if found:
        return found
    try:
        from onceflow.embedded import _valkey_executable

        return str(_valkey_executable())
    except Exception:  # the embedded extra is absent, or ships no binary
        return None


def _os_port() -> int:
    """A port the OS calls free now (released at once: another call may return it again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _free_port(avoid: Collection[int] = ()) -> int:
    """A free port whose cluster bus port (port + 10000) is free too, clashing with none of
    ``avoid`` (the cluster's other ports, which the OS may still call free: a node not
    started yet, or one that exited) nor with their bus ports."""
    for _ in range(200):
        port = _os_port()
        if port > 55000 or {port, port + 10000, port - 10000} & set(avoid):
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def _wait(condition: object, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():  # type: ignore[operator]
                return
        except (redis.RedisError, OSError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class LocalCluster:
    """Three cluster primaries of this test run's own (no replicas)."""

    def __init__(self, binary: str, nodes: int = 3) -> None:
        self.binary = binary
        #: Every port this cluster has used: a node restarted elsewhere never takes the port
        #: of another (two nodes on one port: one entry in ``procs``, a node never stopped).
        self.used: list[int] = []
        for _ in range(nodes):
            self.used.append(_free_port(self.used))
        self.ports = list(self.used)
        self.dir = Path(tempfile.mkdtemp(prefix="onceflow-cluster-"))
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

    @property
    def url(self) -> str:
        """onceflow's URL of the cluster: every node a startup node."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def node(self, port: int) -> redis.Redis:
        """A plain client of one node."""
        return redis.Redis(port=port, socket_timeout=5, socket_connect_timeout=2)

    def _spawn(self, port: int) -> None:
        argv = [
            self.binary, "--port", str(port), "--bind", "127.0.0.1",
            "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
            "--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no",
            "--save", "", "--appendonly", "no", "--dir", str(self.dir),
        ]  # fmt: skip
        assert port not in self.procs, f"port {port} is taken by a node of this cluster"
        with open(self.dir / f"node-{port}.log", "wb") as log:
            self.procs[port] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)

    def _up(self, index: int) -> None:
        """Node ``index`` answering. A free port can be taken between its choice and the
        server's bind (by any process's outgoing connection): a node that exits before it
        answers is started again on another free pair, a few times."""
        for _ in range(5):
            port = self.ports[index]
            _wait(lambda: self._answers_or_exited(port), f"cluster node on port {port}")  # noqa: B023
            if self.procs[port].poll() is None:
                return
            self.ports[index] = _free_port(self.used)
            self.used.append(self.ports[index])
            self._spawn(self.ports[index])
        log = (self.dir / f"node-{self.ports[index]}.log").read_text(errors="replace")
        raise AssertionError(f"a cluster node would not start: {log[-2000:]}")

    def _answers_or_exited(self, port: int) -> bool:
        if self.procs[port].poll() is not None:
            return True
        # One short try, no retries: whatever holds a taken port may never answer.
        quick = redis.Redis(
            port=port, socket_timeout=0.5, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0)
        )
        try:
            return bool(quick.ping())
        finally:
            quick.close()

    def start(self) -> LocalCluster:
        """The nodes up and met; on any failure every node started is stopped again."""
        try:
            for port in self.ports:
                self._spawn(port)
            for index in range(len(self.ports)):
                self._up(index)
            for port, (low, high) in zip(self.ports, SLOT_RANGES, strict=True):
                self.node(port).execute_command("CLUSTER", "ADDSLOTSRANGE", low, high)
            first = self.node(self.ports[0])
            for port in self.ports[1:]:
                first.execute_command("CLUSTER", "MEET", "127.0.0.1", port)
            for port in self.ports:
                _wait(lambda p=port: self._ready(p), f"cluster_state:ok on port {port}")  # type: ignore[misc]
        except BaseException:
            self.stop()
            raise
        return self

    def _ready(self, port: int) -> bool:
        client = self.node(port)
        info = client.execute_command("CLUSTER", "INFO")
        text = info.decode() if isinstance(info, bytes) else str(info)
        if "cluster_state:ok" not in text:
            return False
        nodes = client.execute_command("CLUSTER", "NODES")
        lines = (nodes.decode() if isinstance(nodes, bytes) else str(nodes)).strip().splitlines()
        return len(lines) == len(self.ports) and all("connected" in ln for ln in lines)

    def port_of(self, key: str) -> int:
        """The port of the primary whose slot range holds ``key``."""
        slot = key_slot(key.encode())
        for port, (low, high) in zip(self.ports, SLOT_RANGES, strict=True):
            if low <= slot <= high:
                return port
        raise AssertionError(f"slot {slot} in no range")

    def kill(self, port: int) -> None:
        """Stop one node (SIGKILL): its slots stay assigned to it, and go dark."""
        proc = self.procs[port]
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

    def stop(self) -> None:
        for port in list(self.procs):
            self.kill(port)
        shutil.rmtree(self.dir, ignore_errors=True)
