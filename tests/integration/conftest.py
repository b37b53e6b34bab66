"""Integration fixtures: real nats-server (JetStream) and a real Redis-compatible server, started
per test under its own data dir, plus the real worker processes under a supervisor."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import pytest

from aios_blocks.bus.nats_bus import security_options
from aios_blocks.cli.client import TERMINAL, Client, event_kind
from aios_blocks.runtime.embedded import EmbeddedServers
from aios_blocks.runtime.supervisor import DEFAULT_GROUPS, Supervisor
from aios_blocks.schemas.spec import Cluster, Gpu, Node
from aios_blocks.settings import Settings
from aios_blocks.workers.base import Worker

pytestmark = pytest.mark.integration

COMPONENT: dict[str, Any] = {
    "componentURI": "aios://test/model",
    "image": "aios/test:1",
    "componentInitData": {"model": "m"},
    "componentInitSettings": {"batch": 4},
    "componentParameters": {"temperature": 0.5},
    "componentMetadata": {"owner": "tests"},
    "tags": ["test"],
    "resources": {"gpus": 1, "gpuMemory": 0, "cpu": 1, "memory": 1024},
    "policies": [
        {"name": "clusterAllocator", "policyRuleURI": "builtin:cluster-rank", "parameters": {}, "settings": {}},
        {"name": "resourceAllocator", "policyRuleURI": "builtin:binpack", "parameters": {}, "settings": {}},
    ],
}


@dataclass
class System:
    servers: EmbeddedServers | None
    supervisor: Supervisor
    client: Client
    data_dir: Path

    def instance_headers(self, node: str, iid: str) -> dict[str, str]:
        """What an executor adds to a task for instance ``iid`` on ``node``: its token, when the
        servers made an instance key (auth on; docs/security.md). A test that talks to an
        instance's port directly sends it, as only the executors may."""
        from aios_blocks.runtime import instance_key

        key = instance_key.read(self.data_dir) if self.servers is not None and self.servers.auth else None
        return {"Aios-Instance-Token": instance_key.token(key, node, iid)} if key else {}

    async def submit_and_wait(self, spec: dict[str, Any], timeout: float = 60) -> tuple[str, str, dict[str, Any]]:
        bid = await self.client.submit(spec)
        kind, env = await self.client.wait(bid, timeout)
        return bid, kind, env

    async def wait_all(self, bids: set[str], timeout: float = 120) -> dict[str, tuple[str, dict[str, Any]]]:
        """Terminal event of every block in ``bids`` (one ordered consumer over all blocks)."""
        done: dict[str, tuple[str, dict[str, Any]]] = {}
        async with asyncio.timeout(timeout):
            async for subject, env in self.client.follow("*"):
                bid, kind = subject.split(".")[2], event_kind(subject)
                if bid in bids and kind in TERMINAL and bid not in done:
                    done[bid] = (kind, env)
                    if len(done) == len(bids):
                        return done
        return done


async def desk_ready(client: Client, timeout: float = 60) -> None:
    """Until the gateway's tenant desk answers (a history request of no block: 404): a tenant's
    create reaches ``AIOS_INTAKE`` through it (``workers.tenants``), so a tenant's client that
    publishes before the gateway runs finds no responders, as a real one would. Only for the test
    modules that say ``NEEDS_DESK = True``: waiting in every test changed when the others start
    (a replay of a drain's reassignment input then read `mismatch`, test_placement_reason: not
    understood yet)."""
    subject = "aios.tenant._up.block._up.history"
    async with asyncio.timeout(timeout):
        while True:
            try:
                await client.bus.nc.request(subject, b"", timeout=2)
                return
            except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                await asyncio.sleep(0.1)


@pytest.fixture
async def system(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[System]:
    data = tmp_path / "data"
    servers = None
    nats_url, redis_url = os.environ.get("AIOS_NATS_URL"), os.environ.get("AIOS_REDIS_URL")
    if not (nats_url and redis_url):
        servers = EmbeddedServers(data_dir=data).start()
        nats_url, redis_url = servers.nats_url, servers.redis_url
    role_env = servers.worker_env if servers else None  # each worker with its own role's credentials
    # the processes of `blocks up`: the kinds grouped (supervisor.DEFAULT_GROUPS)
    sup = Supervisor(nats_url, redis_url, log_dir=str(data / "logs"), role_env=role_env, groups=DEFAULT_GROUPS).start()
    client = await Client.open(nats_url, redis_url)
    await client.add_component(COMPONENT)
    try:
        if getattr(request.module, "NEEDS_DESK", False):  # its tenants' creates go through the desk
            await desk_ready(client)
        yield System(servers, sup, client, data)
    finally:
        await client.close()
        sup.stop()
        if servers:
            servers.stop()


@asynccontextmanager
async def worker_rig(tmp_path: Path, kind: str, settings: Settings | None = None,
                     clusters: Sequence[str] = ()) -> AsyncIterator[tuple[Worker, Client]]:
    """One worker of ``kind`` (its handlers called by the test, no runner) on embedded servers of
    its own, a client, and per cluster id one node with one GPU (``{cid}-n0``, ``{cid}-g0``): the
    rig of the single-worker tests. ``settings`` None: the worker's own (``settings.load()``)."""
    servers = EmbeddedServers(data_dir=tmp_path).start()
    w = await Worker.open(servers.nats_url, servers.redis_url, kind, settings=settings)
    client = await Client.open(servers.nats_url, servers.redis_url)
    try:
        for cid in clusters:
            await client.add_cluster(Cluster(id=cid))
            await client.add_node(Node(id=f"{cid}-n0", cluster=cid, gpus=[Gpu(id=f"{cid}-g0")]))
        yield w, client
    finally:
        await client.close()
        await w.close()
        servers.stop()


async def gpu_usage(client: Client, cid: str) -> dict[str, int]:
    """GPU id -> number of reservations holding it, from the reservation records."""
    usage: dict[str, int] = {}
    import msgspec

    for r in await client.store.reservations(cid):
        for g in msgspec.json.decode(r["gpus"]):
            usage[g] = usage.get(g, 0) + 1
    return usage


@dataclass
class Conn:
    """A raw nats-py connection as one user (a third-party client), collecting the server's
    asynchronous errors (``connect`` below)."""

    nc: Any
    user: str
    errors: list[str] = field(default_factory=list)

    async def denied(self, subject: str, what: str = "publish") -> bool:
        """Whether the server reported this violation (its -ERR may trail the next PONG a little)."""
        needle = f'permissions violation for {what} to "{subject}"'.lower()  # nats-py lowercases it
        for _ in range(250):
            await self.nc.flush(timeout=5)
            if any(needle in e.lower() for e in self.errors):
                return True
            await asyncio.sleep(0.02)
        return False

    async def refused(self, subject: str, body: dict[str, Any] | None = None) -> bool:
        """A JetStream API request the server drops as a permissions violation (no answer)."""
        with pytest.raises(nats.errors.TimeoutError):
            await self.nc.request(subject, json.dumps(body or {}).encode(), timeout=0.75)
        return await self.denied(subject)


@pytest.fixture
async def connect() -> AsyncIterator[Any]:
    """``await connect(url)``: a ``Conn`` as the URL's user, closed after the test."""
    conns: list[Conn] = []

    async def open_(url: str) -> Conn:
        c = Conn(None, url.split("//", 1)[1].split(":", 1)[0] if "@" in url else "")

        async def error_cb(exc: Exception) -> None:
            c.errors.append(str(exc))

        c.nc = await nats.connect(servers=[url], error_cb=error_cb, allow_reconnect=False, connect_timeout=5,
                                  **security_options(url))
        conns.append(c)
        return c

    yield open_
    for c in conns:
        await c.nc.close()
