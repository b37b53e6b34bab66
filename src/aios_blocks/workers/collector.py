"""The metrics collector (``blocks worker metrics``, started by ``blocks up``; docs/metrics.md).

Every ``metrics_interval_s`` it:

1. reads each instance's ``/metrics`` (the endpoints of the blocks' instance maps, watched like
   the executors watch them: a full snapshot, then each change) and every executor's
   ``/metrics`` (their targets are announced in the metrics store);
2. turns the cumulative figures into one sample per instance and per block (``metrics.window``:
   rates and latency quantiles over the last ``metrics_rate_span_s``);
3. writes them to the local cluster metrics store (``state.metrics``: the latest sample and a
   window of ``metrics_window_s`` per instance and block), where the controller takes the
   resourceAllocator's ``block_metrics`` and the executors take the loadBalancer's instance
   metrics, and ``blocks top`` reads them;
4. queues them for the global metrics DBs, when ``metrics_remote_write_url`` names any
   (``metrics.remote_write``: Prometheus remote write, sent every ``metrics_remote_write_interval_s``).

One collector writes a scope (all blocks, or with ``--cluster`` the blocks placed in one
cluster): it holds a lease in the store, and a copy waits to take over. Every copy serves the
Prometheus http_sd documents (``/sd/workers``, ``/sd/instances``) and the latest block samples
(``/blocks``) on ``metrics_sd_port`` (``blocks up`` writes it to endpoints.json as ``metrics``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import socket
import time

import aiohttp
import structlog
from aiohttp import web

from ..bus.instance_map import InstanceMaps
from ..metrics import promconfig, remote_write
from ..metrics.scrape import ExecBlock, InstanceReading, read_executor, read_instance
from ..metrics.window import BlockInput, Windows
from ..runtime.httperrors import json_errors
from ..runtime.ticker import Ticker
from ..schemas.protocol import METRICS_PATH
from ..schemas.records import BlockMap
from .base import Worker

log = structlog.get_logger("aios.collector")

#: instance states whose /metrics is read (a starting instance may not listen yet)
SCRAPED = ("ready", "draining")
#: pages read at once
CONCURRENCY = 256


class Collector:
    def __init__(self, w: Worker, cluster: str | None = None):
        self.w, self.s = w, w.settings
        self.scope = cluster or "all"
        self.cluster = cluster
        self.holder = f"collector-{socket.gethostname()}-{os.getpid()}"
        self.maps: dict[str, BlockMap] = {}
        #: block -> (generation, cluster): the map's, else the block record's
        self.clusters: dict[str, tuple[int, str]] = {}
        self.windows = Windows(self.s.metrics_rate_span_s)
        self.written: set[str] = set()
        self.leading = False
        self.ticks = 0
        self.session: aiohttp.ClientSession | None = None
        self._sem = asyncio.Semaphore(CONCURRENCY)
        urls = remote_write.urls_of(self.s.metrics_remote_write_url)
        self.remote = remote_write.RemoteWrite(urls, self.s.metrics_remote_write_timeout_s,
                                               self.s.metrics_remote_write_max_samples) if urls else None

    # -- the instance maps -----------------------------------------------------------------------
    async def on_map(self, bid: str, value: BlockMap | None, rev: int) -> None:
        if value is None:
            self.maps.pop(bid, None)
            self.clusters.pop(bid, None)
            return
        self.maps[bid] = value
        gen = int(value.get("gen", 0))
        if value.get("cluster"):  # the mapper names the block's cluster
            self.clusters[bid] = (gen, str(value["cluster"]))
        elif self.clusters.get(bid, (-1, ""))[0] != gen:
            block = await self.w.store.get_block(bid)
            self.clusters[bid] = (gen, str((block or {}).get("cluster") or ""))

    def covered(self) -> dict[str, BlockMap]:
        if self.cluster is None:
            return dict(self.maps)
        return {b: m for b, m in self.maps.items() if self.clusters.get(b, (0, ""))[1] == self.cluster}

    def cluster_of(self, bid: str) -> str:
        return self.clusters.get(bid, (0, ""))[1]

    # -- scraping --------------------------------------------------------------------------------
    async def _get(self, url: str) -> str | None:
        assert self.session is not None
        async with self._sem:
            try:
                async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=self.s.metrics_scrape_timeout_s)) as r:
                    if r.status != 200:
                        return None
                    return await r.text()
            except (aiohttp.ClientError, TimeoutError, ValueError):
                return None

    async def read(self) -> dict[str, BlockInput]:
        """One reading of every covered instance and every executor."""
        maps = self.covered()
        jobs: list[tuple[str, str]] = []
        for bid, m in maps.items():
            for iid, rec in (m.get("instances") or {}).items():
                if rec.get("state") in SCRAPED and rec.get("endpoint"):
                    jobs.append((bid, iid))
        executors = await self.w.store.metrics.targets("executor")
        texts = await asyncio.gather(
            *(self._get(maps[b]["instances"][i]["endpoint"].rstrip("/") + METRICS_PATH) for b, i in jobs),
            *(self._get(str(t["url"])) for t in executors),
        )
        ex: dict[str, ExecBlock] = {}
        for text in texts[len(jobs):]:
            if text is not None:
                read_executor(text, ex)
        pages: dict[str, dict[str, InstanceReading | None]] = {}
        for (bid, iid), text in zip(jobs, texts[: len(jobs)], strict=True):
            pages.setdefault(bid, {})[iid] = read_instance(text) if text is not None else None
        return {bid: BlockInput(self.cluster_of(bid), (m.get("instances") or {}).copy(), pages.get(bid, {}), ex.get(bid))
                for bid, m in maps.items()}

    async def tick(self) -> bool:
        """One round (only by the lease holder); True when it wrote."""
        interval = self.s.metrics_interval_s
        self.leading = await self.w.store.metrics.lead(self.scope, self.holder, max(3 * interval, 2.0))
        if not self.leading:
            self.written.clear()
            return False
        await self.w.store.metrics.prune_targets()
        inputs = await self.read()
        samples = self.windows.tick(time.time(), inputs)
        keep = max(2, math.ceil(self.s.metrics_window_s / interval))
        gone = sorted(self.written - set(samples))
        await self.w.store.metrics.write(samples, keep, self.s.metrics_window_s + 10 * interval, gone)
        if self.remote is not None:  # the global metrics DBs: only the scope's writer, so once
            self.remote.add(remote_write.points(samples))
        self.written = set(samples)
        self.ticks += 1
        return True

    async def loop(self, stop: asyncio.Event) -> None:
        await Ticker(self.s.metrics_interval_s, "collector.tick_failed", log).run(self.tick, stop)

    # -- discovery for Prometheus --------------------------------------------------------------------
    def app(self) -> web.Application:
        async def sd_workers(request: web.Request) -> web.Response:
            return web.json_response(promconfig.worker_targets(await self.w.store.metrics.targets()))

        async def sd_instances(request: web.Request) -> web.Response:
            maps = self.covered()
            return web.json_response(promconfig.instance_targets(maps, {b: self.cluster_of(b) for b in maps}))

        async def blocks(request: web.Request) -> web.Response:
            return web.json_response(await self.w.store.metrics.blocks())

        async def health(request: web.Request) -> web.Response:
            doc = {"status": "ok", "leading": self.leading, "blocks": len(self.maps), "ticks": self.ticks}
            if self.remote is not None:
                doc["remote_write"] = self.remote.status()
            return web.json_response(doc)

        app = web.Application(middlewares=[json_errors()])  # an unknown path, a wrong method: JSON
        app.router.add_get("/sd/workers", sd_workers)
        app.router.add_get("/sd/instances", sd_instances)
        app.router.add_get("/blocks", blocks)
        app.router.add_get("/health", health)
        return app

    async def run(self, stop: asyncio.Event) -> None:
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30))
        ready = asyncio.Event()
        watch = asyncio.get_running_loop().create_task(InstanceMaps(self.w.bus, create=False).watch(self.on_map, stop, ready))
        push = (asyncio.get_running_loop().create_task(self.remote.run(stop, self.s.metrics_remote_write_interval_s))
                if self.remote is not None else None)
        runner = web.AppRunner(self.app(), access_log=None)
        try:
            await runner.setup()
            # every copy serves the same documents (SO_REUSEPORT): Prometheus keeps one URL
            await web.TCPSite(runner, self.s.metrics_host, self.s.metrics_sd_port, reuse_port=True).start()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ready.wait(), 10)
            log.info("collector.serving", scope=self.scope, sd_port=self.s.metrics_sd_port, blocks=len(self.maps))
            await self.loop(stop)
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watch
            if push is not None:  # its last flush (stop is set) within one request's time limit
                with contextlib.suppress(TimeoutError, asyncio.CancelledError, Exception):
                    await asyncio.wait_for(push, self.s.metrics_remote_write_timeout_s + 1)
            await runner.cleanup()
            await self.session.close()


async def run(w: Worker, stop: asyncio.Event, cluster: str | None = None) -> None:
    await Collector(w, cluster).run(stop)
