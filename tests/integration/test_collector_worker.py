"""The metrics collector's decisions (``workers/collector.py``) on a real Redis, in-process, with
instances that are small HTTP servers: which block is whose (the map's cluster, else the block
record's, read once per generation), what a ``--cluster`` collector covers, which instances are
read (ready or draining, with an endpoint), that one copy writes a scope (the lease), that a block
no longer covered loses its latest sample, and what its discovery documents list."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from aios_blocks.runtime.embedded import EmbeddedServers
from aios_blocks.settings import Settings
from aios_blocks.state.keys import block_key
from aios_blocks.workers.base import Worker
from aios_blocks.workers.collector import Collector

pytestmark = pytest.mark.integration

PAGE = """# TYPE aios_instance_requests_running gauge
aios_instance_requests_running 2
# TYPE aios_instance_requests_waiting gauge
aios_instance_requests_waiting 1
"""


class Instance:
    """An instance's /metrics page, counting the reads."""

    def __init__(self) -> None:
        self.reads = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> Instance:
        async def metrics(request: web.Request) -> web.Response:
            self.reads += 1
            return web.Response(text=PAGE)

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self


@pytest.fixture
async def w(tmp_path: Path) -> AsyncIterator[Worker]:
    servers = EmbeddedServers(data_dir=tmp_path).start()
    worker = await Worker.open(servers.nats_url, servers.redis_url, "metrics", settings=Settings(metrics_interval_s=1))
    try:
        yield worker
    finally:
        await worker.close()
        servers.stop()


@pytest.fixture
async def instances() -> AsyncIterator[list[Instance]]:
    out = [await Instance().start() for _ in range(3)]
    try:
        yield out
    finally:
        for i in out:
            assert i.runner is not None
            await i.runner.cleanup()


def _map(gen: int, cluster: str = "", **insts: tuple[str, str]) -> dict[str, Any]:
    return {"block_id": "b", "gen": gen, "cluster": cluster,
            "instances": {iid: {"node": "n1", "state": st, "endpoint": ep} for iid, (st, ep) in insts.items()}}


async def _collector(w: Worker, cluster: str | None = None) -> Collector:
    c = Collector(w, cluster)
    c.session = aiohttp.ClientSession()
    return c


async def test_a_block_is_attributed_to_the_maps_cluster_else_the_block_records_once_per_generation(w: Worker) -> None:
    c = await _collector(w)
    try:
        await c.on_map("a", _map(1, "c1"), 1)
        assert c.cluster_of("a") == "c1"
        await w.store.create_block("b", 1, "d", {"status": "ready", "cluster": "c2"})
        await c.on_map("b", _map(1), 2)
        assert c.cluster_of("b") == "c2"
        await w.store.r.hset(block_key("b"), "cluster", "c9")
        await c.on_map("b", _map(1), 3)  # the same generation: not read again
        assert c.cluster_of("b") == "c2"
        await c.on_map("b", _map(2), 4)  # a new generation: read again
        assert c.cluster_of("b") == "c9"
        await c.on_map("b", None, 5)  # the map deleted: forgotten
        assert "b" not in c.maps and c.cluster_of("b") == ""
        await c.on_map("x", _map(1), 6)  # no map cluster, no block record: no cluster
        assert c.cluster_of("x") == ""
        # a --cluster collector covers only the blocks of its cluster
        one = await _collector(w, "c1")
        try:
            for bid, m in c.maps.items():
                await one.on_map(bid, m, 7)
            assert set(one.covered()) == {"a"} and set(c.covered()) == {"a", "x"}
        finally:
            assert one.session is not None
            await one.session.close()
    finally:
        assert c.session is not None
        await c.session.close()


async def test_only_ready_and_draining_instances_with_an_endpoint_are_read(w: Worker, instances: list[Instance]) -> None:
    ready, draining, starting = instances
    c = await _collector(w)
    try:
        await c.on_map("b", _map(1, "c1", **{"b-0": ("ready", ready.url), "b-1": ("draining", draining.url),
                                             "b-2": ("starting", starting.url), "b-3": ("ready", ""),
                                             "b-4": ("ready", "http://127.0.0.1:9")}), 1)
        inputs = await c.read()
        b = inputs["b"]
        assert (ready.reads, draining.reads, starting.reads) == (1, 1, 0)
        assert b.cluster == "c1" and set(b.instances) == {"b-0", "b-1", "b-2", "b-3", "b-4"}
        assert set(b.pages) == {"b-0", "b-1", "b-4"} and b.pages["b-4"] is None  # unreachable: no page
        page = b.pages["b-0"]
        assert page is not None and (page.running, page.waiting) == (2.0, 1.0)
    finally:
        assert c.session is not None
        await c.session.close()


async def test_one_copy_writes_a_scope_and_a_block_gone_loses_its_sample(w: Worker, instances: list[Instance]) -> None:
    first, second = await _collector(w), await _collector(w)
    second.holder = first.holder + "-copy"
    try:
        for col in (first, second):
            await col.on_map("b", _map(1, "c1", **{"b-0": ("ready", instances[0].url)}), 1)
            await col.on_map("z", _map(1, "c1", **{"z-0": ("ready", instances[1].url)}), 2)
        assert await first.tick() is True and first.leading
        assert await second.tick() is False and not second.leading  # the lease is the first's
        assert instances[0].reads == 1  # read once, by the writer
        assert set(await w.store.metrics.blocks()) == {"b", "z"}
        assert set(await w.store.metrics.instances("b")) == {"b-0"}
        # block z's map goes: the next tick removes its latest sample and its instances' samples
        await first.on_map("z", None, 3)
        assert await first.tick() is True and first.ticks == 2
        assert set(await w.store.metrics.blocks()) == {"b"} and await w.store.metrics.instances("z") == {}
    finally:
        for col in (first, second):
            assert col.session is not None
            await col.session.close()


async def test_the_discovery_documents_list_what_the_collector_covers(w: Worker, instances: list[Instance]) -> None:
    c = await _collector(w, "c1")
    try:
        await c.on_map("b", _map(1, "c1", **{"b-0": ("ready", instances[0].url), "b-1": ("stopping", instances[1].url)}), 1)
        await c.on_map("o", _map(1, "c2", **{"o-0": ("ready", instances[2].url)}), 2)
        async with TestClient(TestServer(c.app())) as http:
            health = await (await http.get("/health")).json()
            assert health == {"status": "ok", "leading": False, "blocks": 2, "ticks": 0}
            sd = await (await http.get("/sd/instances")).json()
            assert [(t["labels"]["block"], t["labels"]["instance"], t["labels"]["cluster"]) for t in sd] == [("b", "b-0", "c1")]
            await c.tick()
            assert (await (await http.get("/health")).json())["leading"] is True
            assert set(await (await http.get("/blocks")).json()) == {"b"}
            # a wrong path or method: JSON with its status, as every error of the servers users call
            for method, path, status in (("GET", "/sd/nothing", 404), ("POST", "/blocks", 405)):
                async with http.request(method, path) as r:
                    assert r.status == status and r.content_type == "application/json", (path, await r.text())
                    assert (await r.json())["status"] == status
    finally:
        assert c.session is not None
        await c.session.close()
