"""Network links a test can cut: small TCP proxies on loopback, each forwarding one listening port
to one target port, all run by one asyncio loop in a background thread (so a test blocked in a
``subprocess.run`` or a sync fixture does not stall the traffic).

A *cut* link closes every connection through it at once (both ends see the TCP connection go) and
refuses new ones (accepted and closed at once) until it is *healed*: what a partition looks like
to processes that use TCP keepalive/pings, without root, iptables, namespaces or Docker networks
(CI's Docker runs with ``--iptables=false --bridge=none``; docs/testing.md says why this was
chosen). A silent partition (packets dropped, sockets open) is what SIGSTOP of a server gives.

``PartitionedNats`` puts every route between the three servers of ``cluster_servers.NatsCluster``
and every client connection to each server through such links: route ``i -> j`` has its own link
(one per ordered pair: the servers dial each other), and each server has one client door. To cut
a server off from the others and from the workers: ``isolate(name)``; ``heal()`` restores all."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aios_blocks.runtime.embedded import nats_binary

from .cluster_servers import NatsCluster, _popen, _wait_port, stable_port

T = TypeVar("T")


class Links:
    """The loop that runs every link, in its own thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="links", daemon=True)
        self.thread.start()
        self.links: list[Link] = []

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def add(self, target_port: int, name: str = "") -> Link:
        link = Link(self, target_port, name or f"->{target_port}")
        self.call(link._start())
        self.links.append(link)
        return link

    def close(self) -> None:
        for link in self.links:
            with contextlib.suppress(Exception):
                self.call(link._close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


@dataclass(eq=False)
class Link:
    owner: Links
    target_port: int
    name: str
    port: int = 0
    is_cut: bool = False
    accepted: int = 0
    refused: int = 0
    _server: asyncio.base_events.Server | None = None
    _conns: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = field(default_factory=set)

    async def _start(self) -> None:
        self.port = self.port or stable_port()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.is_cut:
            self.refused += 1
            writer.transport.abort()
            return
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self.accepted += 1
        pair = (writer, up_w)
        self._conns.add(pair)
        try:
            await asyncio.gather(_pipe(reader, up_w), _pipe(up_r, writer))
        finally:
            self._conns.discard(pair)
            for w in pair:
                w.transport.abort()

    async def _cut(self) -> None:
        self.is_cut = True
        for pair in list(self._conns):
            for w in pair:
                w.transport.abort()
        self._conns.clear()

    async def _heal(self) -> None:
        self.is_cut = False

    async def _close(self) -> None:
        await self._cut()
        if self._server is not None:
            self._server.close()

    def cut(self) -> None:
        """Drop every connection through the link and refuse new ones."""
        self.owner.call(self._cut())

    def heal(self) -> None:
        self.owner.call(self._heal())

    @property
    def open_connections(self) -> int:
        return len(self._conns)


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, asyncio.IncompleteReadError, ConnectionError):
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
    dst.transport.abort()


@dataclass
class PartitionedNats(NatsCluster):
    """``NatsCluster`` with every route and client connection through a ``Link``.

    Each server's configured routes point at its own links to the two others, and it advertises
    a route address where nothing listens (``cluster.advertise``): the full mesh comes from the
    configured routes only, so a server never learns (by gossip) a direct address that would
    bypass a cut. ``no_advertise`` keeps the servers from telling clients each other's real
    client ports: clients know only the doors in ``url``. Short route/client pings make a
    silent peer (SIGSTOP) count as gone within seconds instead of minutes."""

    links: Links | None = None
    routes: dict[tuple[str, str], Link] = field(default_factory=dict)
    doors: dict[str, Link] = field(default_factory=dict)
    dead_port: int = 0
    ping_interval_s: int = 2

    @property
    def url(self) -> str:
        return ",".join(f"nats://127.0.0.1:{self.doors[n].port}" for n in self.names())

    def direct_url(self, name: str) -> str:
        """The server's own client port, not through its door (for the test's observer)."""
        return f"nats://127.0.0.1:{self.client_ports[self.names().index(name)]}"

    def start(self) -> PartitionedNats:
        self.links = Links()
        ports: list[int] = []
        while len(ports) < 2 * self.size + 1:
            if (port := stable_port()) not in ports:
                ports.append(port)
        self.client_ports, self.route_ports = ports[:self.size], ports[self.size:2 * self.size]
        self.dead_port = ports[-1]
        names = self.names()
        for i, a in enumerate(names):
            self.doors[a] = self.links.add(self.client_ports[i], f"client->{a}")
            for j, b in enumerate(names):
                if i != j:
                    self.routes[(a, b)] = self.links.add(self.route_ports[j], f"{a}->{b}")
        for name in names:
            self.start_server(name)
        return self

    def start_server(self, name: str) -> None:
        i = self.names().index(name)
        d = self.data_dir / name
        d.mkdir(parents=True, exist_ok=True)
        routes = ", ".join(f'"nats-route://127.0.0.1:{self.routes[(name, b)].port}"' for b in self.names() if b != name)
        conf = d / "nats.conf"
        conf.write_text(
            f"server_name: {name}\n"
            f'listen: "127.0.0.1:{self.client_ports[i]}"\n'
            f"ping_interval: {self.ping_interval_s}\nping_max: 2\n"
            "max_payload: 8MB\n"
            f'jetstream {{ store_dir: "{d / "js"}", sync_interval: always }}\n'
            f'cluster {{ name: aios, listen: "127.0.0.1:{self.route_ports[i]}", no_advertise: true,\n'
            f'  advertise: "127.0.0.1:{self.dead_port}", routes: [{routes}] }}\n'
        )
        proc = _popen([nats_binary(), "-c", str(conf), "-l", str(d / "nats.log")], d / "stdout.log")
        self.procs[name] = proc
        _wait_port(self.client_ports[i], proc, f"nats-server {name}")

    def isolate(self, name: str) -> None:
        """Cut ``name`` off from the other servers (both directions) and from every client."""
        for (a, b), link in self.routes.items():
            if name in (a, b):
                link.cut()
        self.doors[name].cut()

    def heal(self) -> None:
        for link in [*self.routes.values(), *self.doors.values()]:
            link.heal()

    def stop(self) -> None:
        super().stop()
        if self.links is not None:
            self.links.close()
            self.links = None


__all__ = ["Link", "Links", "PartitionedNats"]
